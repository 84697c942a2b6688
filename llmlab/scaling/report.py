"""The lr_bs sweep's scaling report: scaling_fits.json, scaling_report.md and plots/*.png in the sweep folder."""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from llmlab.core.io import atomic_write_json, atomic_write_text
from llmlab.scaling.fits import ScalingOptions, analyse, predict_band

FITS_FILE = "scaling_fits.json"
REPORT_FILE = "scaling_report.md"
PLOT_NAMES = ("loss_vs_lr.png", "lr_opt_fit.png", "peak_memory_fit.png", "loss_std_fit.png", "lr_transfer.png")


def write_lr_bs_report(out_dir: str | os.PathLike, rows: list[dict], options: Optional[ScalingOptions] = None) -> dict:
    """Analyse an lr x batch-size sweep and write its fits, report and plots; returns the analysis."""
    out_dir = Path(out_dir)
    analysis = analyse(rows, options or ScalingOptions())
    atomic_write_json(out_dir / FITS_FILE, analysis)
    plots = write_plots(out_dir / "plots", analysis)
    atomic_write_text(out_dir / REPORT_FILE, report_markdown(analysis, plots))
    return analysis


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _interval(ci: list[float]) -> str:
    return f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


def _holdout_caveats(holdout: dict) -> list[str]:
    """Say when the check cannot fail (a band spanning orders of magnitude) or rests on too few points."""
    from llmlab.scaling.transfer import UNINFORMATIVE_BAND, band_ratio

    fit, notes = holdout["fit"], []
    widest = band_ratio(holdout)
    if widest > UNINFORMATIVE_BAND:
        notes.append(f"**The band spans {widest:,.0f}x: too wide for \"inside\" to test anything**; judge the forecast "
                     "by predicted / measured.")
    spare = fit["n_inliers"] - (2 + int(fit["with_batch"]))
    if spare < 2:
        notes.append(f"The fit on the smaller sizes has {spare} residual degree(s) of freedom, so its band is unreliable "
                     "either way; scan more sizes or batch sizes for a check that can fail.")
    return [line for note in notes for line in ("", note)]


def transfer_markdown(analysis: dict) -> list[str]:
    """Across sizes: the held-out check first (the lab's credibility), then the joint fit and the literature."""
    transfer = analysis.get("transfer")
    if not transfer:
        return []
    level, holdout, fit = analysis["options"]["confidence"], transfer["holdout"], transfer["joint_fit"]
    lines = ["## Held-out check: can the small sizes forecast the largest?", ""]
    if holdout.get("status") == "ok":
        verdict = ("inside the band at every batch size" if holdout["all_inside"] else
                   "**outside the band**: this scan's fit does not carry to the held-out size")
        lines += [f"Fitted on {', '.join(holdout['fitted_on'])} only, then asked for {holdout['size']} "
                  f"(N = {holdout['n_params']:,.0f}, {holdout['extrapolation']:.1f}x the next size): the measured "
                  f"lr_opt is {verdict}; median predicted / measured = **{holdout['median_ratio']:.2f}**.", "",
                  f"| batch | predicted lr_opt | {level:.0%} band | measured lr_opt | predicted / measured | inside |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch_size']:g} | {r['predicted']:.3g} | {_interval(r['band'])} | {r['measured']:.3g}"
                  f"{' (grid edge)' if r['measured_at_edge'] else ''} | {r['ratio']:.2f} | "
                  f"{'yes' if r['inside'] else '**no**'} |" for r in holdout["rows"]]
        lines += _holdout_caveats(holdout)
    else:
        lines.append(f"Not run: {holdout.get('reason')}.")
    lines += ["", "## Joint fit across sizes", ""]
    if fit["status"] != "ok":
        return lines + [f"Not fitted: {fit['reason']}.", ""]
    names = ["alpha"] + (["beta"] if fit["with_batch"] else [])
    lines += [f"`{fit['formula']}` on {fit['n_inliers']} of {fit['n_points']} (size, batch) optima, sizes "
              f"{', '.join(fit['sizes'])}: " + ", ".join(f"{n} = {fit[n]:.3f} {_interval(fit[f'{n}_ci'])}" for n in names)
              + (f". **Warning:** {fit['warning']}." if fit.get("warning") else "."), "",
              "| exponent | this lab | Step Law (Li et al. 2025) | DeepSeek LLM (2024) | muP (Yang et al. 2022) |",
              "|---|---|---|---|---|"]
    published = transfer["published"]
    for name in names:
        others = [published[k].get(name) for k in published]
        lines.append(f"| {name} (ln {'N' if name == 'alpha' else 'B, with D = steps x B x seq'}) | {fit[name]:.3f} "
                     f"{_interval(fit[f'{name}_ci'])} | " + " | ".join("-" if v is None else f"{v:+.3f}" for v in others)
                     + " |")
    lines += ["", "The same lrs evaluated at each cell's N and D (tokens = steps x batch x sequence length):", "",
              "| size | N | batch | tokens | measured lr_opt | this lab | Step Law | DeepSeek |", "|---|---|---|---|---|---|---|---|"]
    for r in transfer["literature"]:
        lines.append(f"| {r['size']} | {r['n_params']:,.0f} | {r['batch_size']:g} | {_fmt(r['tokens'])} | "
                     f"{r['measured']:.3g} | {_fmt(r.get('this lab'))} | {_fmt(r.get('Step Law (Li et al. 2025)'))} | "
                     f"{_fmt(r.get('DeepSeek LLM (2024)'))} |")
    return lines + ["", "![lr transfer](plots/lr_transfer.png)", ""]


def report_markdown(analysis: dict, plots: list[str]) -> str:
    level = f"{analysis['options']['confidence']:.0%}"
    thresholds = analysis["thresholds"]
    lines = [
        "# lr x batch-size scaling report", "", *transfer_markdown(analysis),
        f"{analysis['n_trials']} trials, {analysis['n_feasible']} feasible. A trial is dropped when it did not "
        f"finish (status other than ok: OOM, crashed, failed), diverged (final loss > "
        f"{_fmt(thresholds['diverged_loss'], 4)} or not finite) or was unstable (early loss std > "
        f"{_fmt(thresholds['unstable_std'], 4)}: {thresholds['unstable_rule']}).", "",
        "## Dropped trials", "",
    ]
    if analysis["dropped"]:
        lines += ["| trial | lr | batch | reason |", "|---|---|---|---|"]
        lines += [f"| {d['trial_id']} | {_fmt(d['lr'])} | {_fmt(d['batch_size'])} | {d['reason']} |"
                  for d in analysis["dropped"]]
    else:
        lines.append("None.")
    lines += ["", "## Best learning rate per batch size", "",
              "lr_opt is the vertex of a parabola in ln(lr) through the grid's lowest final loss and its two "
              "neighbours; at the edge of the lr grid it is the grid value itself (widen the grid there).", "",
              "| batch | lr_opt | method | grid best lr | best final loss | feasible lrs | in fit |",
              "|---|---|---|---|---|---|---|"]
    for point in analysis["lr_opt_per_batch"]:
        method = point["method"] + (" (at grid edge)" if point["at_edge"] else "")
        used = {True: "yes", False: "outlier (RANSAC)"}.get(point.get("inlier"),
                                                            "no (grid edge)" if point["at_edge"] else "no")
        lines.append(f"| {_fmt(point['batch_size'])} | {_fmt(point['lr_opt'])} | {method} | {_fmt(point['grid_lr'])} "
                     f"| {_fmt(point['best_final_loss'], 4)} | {point['n_lrs']} | {used} |")
    lines += ["", f"## Fits ({level} bootstrap intervals, RANSAC outlier rejection in log space)", "",
              "| fit | estimate | interval | points (inliers) | R^2 (log) |", "|---|---|---|---|---|"]
    for name, fit in analysis["fits"].items():
        if fit["status"] != "ok":
            lines.append(f"| {name} | not fitted: {fit['reason']} | | | |")
            continue
        if name == "loss_std":
            keys = ["k0", "k1", "k2"]
        else:
            keys = ["a", "b"] if name == "lr_opt" else ["c", "d"]
        estimate = f"{fit['formula']}: " + ", ".join(f"{k} = {_fmt(fit[k])}" for k in keys)
        interval = ", ".join(f"{k} {_interval(fit[f'{k}_ci'])}" for k in keys)
        note = f" ({fit['note']})" if fit.get("note") else ""
        lines.append(f"| {name} | {estimate}{note} | {interval} | {fit['n_points']} ({fit['n_inliers']}) "
                     f"| {_fmt(fit['r2_log'])} |")
    warning = analysis["fits"]["lr_opt"].get("warning")
    if warning:
        lines += ["", f"**Warning:** {warning}."]
    lines += ["", "Intervals come from a residual bootstrap on the RANSAC inliers (scipy.stats.bootstrap, "
              f"{analysis['options']['n_bootstrap']} resamples, widened by t/z for the few points of the lr fit).",
              "Early loss std is the raw std of the first 100 training losses, so it also grows with how fast "
              "the loss falls; the default instability threshold is relative to the sweep's median for that reason."]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots]
    lines += ["", "## Next step", "",
              "`python sweep.py recommend --from THIS_FOLDER --memory-gb 24` turns these fits into a training "
              "config (YAML for `train_pretrain.py --config`).", ""]
    return "\n".join(lines)


def _save(fig, path: Path) -> None:
    """savefig to a temp name, then rename: a crash never leaves a truncated PNG."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)


def _power_law_plot(ax, fit: dict, xs: np.ndarray, confidence: float, label: str) -> None:
    grid = np.geomspace(xs.min() / 1.3, xs.max() * 1.3, 60)
    center, low, high = predict_band(fit, np.log(grid)[:, None], confidence)
    ax.plot(grid, np.exp(center), color="C0", label=label)
    ax.fill_between(grid, np.exp(low), np.exp(high), color="C0", alpha=0.2, label=f"{confidence:.0%} band")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    ticks = sorted(set(xs.tolist()))
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # the swept batch sizes, not 10^k labels
    ax.xaxis.set_minor_formatter(NullFormatter())


def _readable_ylim(ax) -> None:
    """Flat data (e.g. the same best lr at every batch) would collapse a log axis: show a factor 4 around it."""
    low, high = ax.get_ylim()
    if low > 0 and high / low < 1.5:
        middle = math.sqrt(low * high)
        ax.set_ylim(middle / 2, middle * 2)


def write_plots(plot_dir: Path, analysis: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    written = [path for make in (_plot_loss_vs_lr, _plot_lr_fit, _plot_memory_fit, _plot_loss_std_fit,
                                 _plot_transfer) if (path := make(plot_dir, analysis))]
    for name in PLOT_NAMES:  # a re-analysis that can no longer fit something must not leave its old plot
        if str(plot_dir / name) not in written:
            (plot_dir / name).unlink(missing_ok=True)
    return written


def _trials_by_id(analysis: dict, ids: list) -> list[dict]:
    trials = {t.get("trial_id"): t for t in analysis["trials"]}
    return [trials[i] for i in ids]


def _feasible(analysis: dict) -> list[dict]:
    return _trials_by_id(analysis, analysis["feasible_ids"])


def _plot_loss_vs_lr(plot_dir: Path, analysis: dict) -> Optional[str]:
    import matplotlib.pyplot as plt

    size = analysis["measured"].get("size")
    feasible = [t for t in _feasible(analysis) if size is None or str(t.get("size")) == size]
    batches = sorted({float(t["batch_size"]) for t in feasible})
    if not batches:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(batches)))
    for colour, batch in zip(colours, batches):
        at_batch = sorted((t for t in feasible if float(t["batch_size"]) == batch), key=lambda t: t["lr"])
        ax.plot([t["lr"] for t in at_batch], [t["final_loss"] for t in at_batch], "o-", color=colour,
                label=f"batch {batch:g}")
    for point in analysis["lr_opt_per_batch"]:
        ax.axvline(point["lr_opt"], color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set(xlabel="learning rate", ylabel="final loss",
           title="Final loss vs lr" + (f" (size {size})" if size else "") + " (dotted: lr_opt)")
    ax.legend(fontsize=8)
    _save(fig, plot_dir / "loss_vs_lr.png")
    return str(plot_dir / "loss_vs_lr.png")


def _plot_lr_fit(plot_dir: Path, analysis: dict) -> Optional[str]:
    import matplotlib.pyplot as plt

    fit = analysis["fits"]["lr_opt"]
    if fit["status"] != "ok":
        return None
    points = [p for p in analysis["lr_opt_per_batch"] if "inlier" in p]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    _power_law_plot(ax, fit, np.array([p["batch_size"] for p in points]), analysis["options"]["confidence"],
                    f"lr_opt = {fit['a']:.3g} * batch^{fit['b']:.3f}")
    for p in points:
        marker = "x" if not p["inlier"] else ("o" if not p["at_edge"] else "s")
        ax.scatter(p["batch_size"], p["lr_opt"], marker=marker, color="C1" if p["inlier"] else "red", zorder=3)
    ax.scatter([], [], marker="x", color="red", label="RANSAC outlier")
    ax.scatter([], [], marker="s", color="C1", label="optimum at lr grid edge (a bound)")
    _readable_ylim(ax)
    ax.set(xlabel="batch size (sequences)", ylabel="best learning rate", title="lr_opt vs batch size")
    ax.legend(fontsize=8)
    _save(fig, plot_dir / "lr_opt_fit.png")
    return str(plot_dir / "lr_opt_fit.png")


def _plot_memory_fit(plot_dir: Path, analysis: dict) -> Optional[str]:
    import matplotlib.pyplot as plt

    from llmlab.scaling.fits import memory_batch

    fit = analysis["fits"]["peak_memory_mb"]
    if fit["status"] != "ok":
        return None
    used = _trials_by_id(analysis, fit["trial_ids"])
    xs = np.array([memory_batch(t) for t in used])
    ys = np.array([float(t["peak_memory_mb"]) for t in used])
    inliers = np.array(fit["inliers"])
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    _power_law_plot(ax, fit, xs, analysis["options"]["confidence"], f"peak = {fit['c']:.3g} * batch^{fit['d']:.3f} MB")
    ax.scatter(xs[inliers], ys[inliers], color="C1", zorder=3, label="trials")
    ax.scatter(xs[~inliers], ys[~inliers], marker="x", color="red", zorder=3, label="RANSAC outlier")
    _readable_ylim(ax)
    ax.set(xlabel="micro batch size (sequences)", ylabel="peak memory (MB)", title="Peak memory vs batch size")
    ax.legend(fontsize=8)
    _save(fig, plot_dir / "peak_memory_fit.png")
    return str(plot_dir / "peak_memory_fit.png")


def _plot_loss_std_fit(plot_dir: Path, analysis: dict) -> Optional[str]:
    import matplotlib.pyplot as plt

    fit = analysis["fits"]["loss_std"]
    if fit["status"] != "ok":
        return None
    used = _trials_by_id(analysis, fit["trial_ids"])
    inliers = np.array(fit["inliers"])
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    std_batches = sorted({float(t["batch_size"]) for t in used})
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(std_batches)))
    inv_lr = np.array([1 / float(t["lr"]) for t in used])
    ys = np.array([float(t["early_loss_std"]) for t in used])
    grid = np.geomspace(inv_lr.min() / 1.3, inv_lr.max() * 1.3, 40)
    for colour, batch in zip(colours, std_batches):
        center, low, high = predict_band(fit, np.column_stack([np.log(grid), np.full_like(grid, math.log(batch))]),
                                         analysis["options"]["confidence"])
        ax.plot(grid, np.exp(center), color=colour, label=f"batch {batch:g}")
        ax.fill_between(grid, np.exp(low), np.exp(high), color=colour, alpha=0.15)
        mask = np.array([float(t["batch_size"]) == batch for t in used])
        ax.scatter(inv_lr[mask & inliers], ys[mask & inliers], color=colour, zorder=3)
        ax.scatter(inv_lr[mask & ~inliers], ys[mask & ~inliers], color="red", marker="x", zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="1 / learning rate", ylabel="early loss std",
           title=f"Early loss std: ln std = {fit['k0']:.2f} + {fit['k1']:.2f} ln(1/lr) + {fit['k2']:.2f} ln(batch)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    _save(fig, plot_dir / "loss_std_fit.png")
    return str(plot_dir / "loss_std_fit.png")


def _plot_transfer(plot_dir: Path, analysis: dict) -> Optional[str]:
    """lr_opt against N per batch size: the joint fit's lines and band, the held-out forecast and measurement."""
    import matplotlib.pyplot as plt

    from llmlab.scaling.transfer import forecast

    transfer = analysis.get("transfer")
    if not transfer or transfer["joint_fit"]["status"] != "ok":
        return None
    fit, points, level = transfer["joint_fit"], transfer["points"], analysis["options"]["confidence"]
    holdout = transfer["holdout"]
    shown = holdout["fit"] if holdout.get("status") == "ok" else fit
    batches = sorted({p["batch_size"] for p in points})
    ns = np.geomspace(min(p["n_params"] for p in points) / 1.5, max(p["n_params"] for p in points) * 1.5, 40)
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for colour, batch in zip(plt.cm.viridis(np.linspace(0, 0.85, len(batches))), batches):
        band = np.array([forecast(shown, n, batch, level) for n in ns])
        ax.plot(ns, band[:, 0], color=colour, label=f"fit, batch {batch:g}")
        ax.fill_between(ns, band[:, 1], band[:, 2], color=colour, alpha=0.15)
        mine = [p for p in points if p["batch_size"] == batch]
        ax.scatter([p["n_params"] for p in mine], [p["lr_opt"] for p in mine], color=colour, zorder=3,
                   marker="o", edgecolor="black")
    if holdout.get("status") == "ok":
        ax.scatter([holdout["n_params"]] * len(holdout["rows"]), [r["predicted"] for r in holdout["rows"]],
                   marker="*", s=140, color="red", zorder=4, label=f"forecast for held-out {holdout['size']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    title = "lr_opt vs non-embedding params N" + (" (fit without the largest size)" if shown is not fit else "")
    ax.set(xlabel="non-embedding parameters N", ylabel="best learning rate", title=title)
    ax.legend(fontsize=7)
    _save(fig, plot_dir / "lr_transfer.png")
    return str(plot_dir / "lr_transfer.png")
