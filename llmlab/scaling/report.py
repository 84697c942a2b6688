"""The lr_bs sweep's scaling report: scaling_fits.json, scaling_report.md and plots/*.png in the sweep folder."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from llmlab.core.io import atomic_write_json, atomic_write_text
from llmlab.scaling.analysis import analyse
from llmlab.scaling.fits import ScalingOptions, memory_batch, predict_band
from llmlab.scaling.law import predict
from llmlab.scaling.length import fit_length_law
from llmlab.scaling.optimum import lr_table

FITS_FILE = "scaling_fits.json"
REPORT_FILE = "scaling_report.md"
PLOT_NAMES = (
    "loss_vs_lr.png",
    "lr_opt_fit.png",
    "peak_memory_fit.png",
    "loss_std_fit.png",
    "lr_transfer.png",
    "loss_vs_lr_sizes.png",
)


def write_lr_bs_report(
    out_dir: str | os.PathLike, rows: list[dict], options: Optional[ScalingOptions] = None, length_law: bool = False
) -> dict:
    """Analyse an lr x batch-size sweep and write its fits, report and plots; returns the analysis. `length_law`: a
    scan across training lengths, whose rows carry D as n_params, also fits ln lr_opt = a + beta ln D on its fit
    lengths (`length`, what `recommend --length_from` reads)."""
    out_dir = Path(out_dir)
    analysis = analyse(rows, options or ScalingOptions())
    if length_law and analysis.get("transfer"):
        analysis["length"] = length_law_of(analysis["transfer"])
    atomic_write_json(out_dir / FITS_FILE, analysis)
    plots = write_plots(out_dir / "plots", analysis)
    atomic_write_text(out_dir / REPORT_FILE, report_markdown(analysis, plots))
    return analysis


def length_law_of(transfer: dict) -> dict:
    """The length law on the measured fit lengths (the held-out one left out), by llmlab.scaling.length's estimator."""
    held = (transfer.get("holdout") or {}).get("size")
    points = [
        {**p, "tokens": p["n_params"]} for p in transfer["points"] if p["status"] == "measured" and p["size"] != held
    ]
    return fit_length_law(points)


def short(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _interval(ci: list[float]) -> str:
    return f"[{short(ci[0])}, {short(ci[1])}]"


def _lr_ci(point: dict) -> str:
    if point["status"] != "measured":
        return f"{short(point.get('lr_opt'))} ({point['status'].replace('_', ' ')}: a bound, not in the fit)"
    ci = point.get("ci")
    return f"{point['lr_opt']:.3g}" + (f" {_interval(ci)}" if ci else " (no seed SD: no interval)")


def _length_line(law: dict) -> str:
    if law.get("status") != "ok":
        return f"not fitted: {law.get('reason')}"
    return f"{law['beta']:+.3f} [{law['beta_ci'][0]:+.3f}, {law['beta_ci'][1]:+.3f}] on {law['df']} df"


def registration_markdown(registration: Optional[dict]) -> list[str]:
    """Which forecast the verdict judges: the pre-registered one (file, sha256, when it was written, whether the
    estimator and rule are still the registered ones) or, without one, a forecast refitted after the data."""
    if not registration:
        return ["Not pre-registered: the forecast below is the law refitted now, so this verdict is exploratory.", ""]
    forecast = registration["forecast"]
    pi = forecast.get("prediction_interval")
    lines = [
        f"Pre-registered in `{registration['file']}` (sha256 `{registration['sha256']}`), written "
        + (
            "before any held-out trial ran"
            if registration.get("written_before_held_out_trials")
            else "**after held-out trials had run: not confirmatory**"
        )
        # a registration from before it recorded its own machine names none: its scan's first machine need not be it
        + (f" on {registration['machine']}" if registration.get("machine") else "")
        + ": forecast lr_opt "
        f"{forecast['lr']:.3g}"
        + (f" {_interval(pi)} (95 % prediction interval)" if pi else "")
        + f", {forecast['source']}."
    ]
    if not registration["estimator_unchanged"] or not registration["rule_unchanged"]:
        lines.append(
            "**The estimator or verdict rule changed after this pre-registration**: the verdict below uses "
            "today's code; a confirmatory verdict needs a new pre-registration and new held-out trials."
        )
    rationale = registration.get("design_rationale") or {}
    if rationale.get("summary"):
        lines.append(
            "Error rates of the registered design, simulated through the whole pipeline "
            f"({rationale.get('reps', '?')} scans per scenario): "
            + "; ".join(f"{k} {v:.0%}" for k, v in rationale["summary"].items())
            + "."
        )
    return lines + [""]


def _trend_line(trend: Optional[dict]) -> list[str]:
    if not trend or trend.get("status") != "ok":
        return []
    return [
        "",
        f"Does the seed noise grow with lr? Slope of ln s^2 on ln lr within sizes: {trend['slope_ln_var']:+.2f} "
        f"{_interval(trend['ci'])} (p = {trend['p']:.2g}, {trend['groups']} replicated lrs): "
        + ("used, sigma varies with lr." if trend["used"] else "not significant, one sigma per size."),
    ]


def verdict_markdown(holdout: dict, registration: Optional[dict] = None) -> list[str]:
    """The held-out line (its verdict word first), the ratio's intervals, power, and what would decide it."""
    # long: a Markdown template, section by section in the order the page reads
    if holdout.get("status") != "ok":
        return [
            f"**held-out: not run** ({holdout.get('reason')}).",
            "",
            *(registration_markdown(registration) if registration else []),
        ]
    fit = holdout["fit"]
    lines = [
        *registration_markdown(registration),
        f"**held-out: {holdout['verdict']}** -- the law fitted on {', '.join(holdout['fitted_on'])} only "
        f"(alpha = {fit['alpha']:.3f} {_interval(fit['alpha_ci'])}, {fit['df']} residual df) forecasts "
        f"{holdout['size']} (N = {holdout['n_params']:,.0f}, {holdout['extrapolation']:.1f}x the largest fitted N)"
        + (f"; worst forecast / measured = **{holdout['worst_ratio']:.2f}**." if holdout.get("worst_ratio") else "."),
        "",
        "| batch | forecast lr_opt (95 % prediction interval) | measured lr_opt (95 % CI) | forecast / measured | "
        "90 % CI | 95 % CI | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in holdout["rows"]:
        ratio = (
            f"{row['ratio']:.2f} | {_interval(row['ci90'])} | {_interval(row['ci95'])}"
            if "ratio" in row
            else "- | - | -"
        )
        lines.append(
            f"| {row['batch_size']:g} | {row['predicted']:.3g} {_interval(row['prediction_interval'])} | "
            f"{short(row.get('measured'))} {_interval(row['measured_ci']) if row.get('measured_ci') else ''} | "
            f"{ratio} | {row['verdict']}{' (' + row['reason'] + ')' if row.get('reason') else ''} |"
        )
    lines.append("")
    for row in holdout["rows"]:
        flat = row.get("flat")
        if flat:
            lines += [
                f"**muP's flat prediction: {flat['verdict']}** -- the fit sizes' mean lr_opt {flat['predicted']:.3g} "
                f"/ measured = {flat['ratio']:.2f}, 90 % CI {_interval(flat['ci90'])}, 95 % CI "
                f"{_interval(flat['ci95'])} ({flat['df']} df; P(95 % CI excludes 1 | 1.5x miss) at this SE "
                f"{flat['power']['detect_1.5x_miss']:.0%}).",
                "",
            ]
        if row.get("power"):
            p = row["power"]
            lines.append(
                f"At this SE of ln R ({row['se_ln']:.3f} on {row['df']} df), treated as known: P(95 % CI "
                f"excludes 1 | 1.5x miss) {p['detect_1.5x_miss']:.0%}, P(failed | 1.5x miss) "
                f"{p['failed_at_1.5x']:.0%}, P(failed | 2x miss) {p['failed_at_2x']:.0%}, P(within | exact) "
                f"{p['within_at_exact']:.0%}, P(failed | exact) {p['failed_at_exact']:.1%}."
            )
        decided = row.get("decided_by")
        if decided:
            seeds = (
                f"{decided['seeds_per_cell']} seeds per cell (now {decided['seeds_now']:g})"
                if decided["seeds_per_cell"]
                else f"no number of seeds up to 32x (now {decided['seeds_now']:g})"
            )
            sizes = (
                f"{decided['extra_fit_sizes']} more fit sizes (now {decided['fit_sizes_now']})"
                if decided["extra_fit_sizes"]
                else "no number of extra sizes up to 12"
            )
            lines.append(
                f"Undecided at batch {row['batch_size']:g}: at the same forecast / measured, {seeds}, or "
                f"{sizes}, would decide it."
            )
    lines += [
        "",
        "Verdicts: `within 1.5x` when the 90 % CI of forecast / measured lies inside [0.67, 1.5] (TOST at "
        "5 %); `failed` when its 95 % CI excludes 1 and the ratio itself lies outside [0.67, 1.5]; `undecided` "
        "otherwise. Var(ln R) = the forecast's variance from the fit + the held-out vertex's variance, on t with "
        "the fit's residual df.",
        "",
    ]
    return lines


def optima_markdown(transfer: dict) -> list[str]:
    """Seed noise (and whether it grows with lr), then lr_opt per size: a value with its CI, or a bound."""
    noise = transfer["noise"]
    sigma = noise["sigma"]
    lines = [
        "## Seed noise and lr_opt per size",
        "",
        f"Seed SD of final loss at equal settings (pure error): sigma = **{short(sigma, 3)}** nats on "
        f"{noise['df']} df"
        + (
            " (per size: "
            + ", ".join(f"{s} {short(v['sigma'], 3)} ({v['df']} df)" for s, v in noise["per_size"].items())
            + ")."
            if sigma
            else "."
        ),
        *_trend_line(noise.get("lr_trend")),
        "",
        "lr_opt is the mean vertex of the quadratics in ln lr over every 5-lr window that contains the lowest "
        "seed-mean loss and brackets its vertex; its 95 % CI is a parametric bootstrap of that whole estimator "
        "with the seed noise above. An optimum on the first or last scanned lr, or one whose bootstrap puts "
        ">= 2.5 % of its draws beyond an end of the grid (censored), is a bound and stays out of the fit. "
        "LR sensitivity (Wortsman et al. 2023) = mean over the scanned lrs within "
        "2.8x of lr_opt of min(L, L_init) - L*: how much a wrong lr costs (lower is more forgiving).",
        "",
        "| size | N | batch | lrs (range) | seeds / lr | lr_opt (95 % CI) | loss at lr_opt | LR sensitivity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in transfer["points"]:
        sens = (p.get("sensitivity") or {}).get("sensitivity")
        span = p.get("lr_range") or [None, None]
        lines.append(
            f"| {p['size']} | {p['n_params']:,.0f} | {p['batch_size']:g} | {p['n_lrs']} ({short(span[0])}-"
            f"{short(span[1])}) | {short(p.get('seeds_per_lr'))} | {_lr_ci(p)} | {short(p.get('loss_at_opt'), 4)} "
            f"| {short(sens, 3)} |"
        )
    return lines


def as_registered_markdown(holdout: dict) -> list[str]:
    """The pooled analysis beside the blocked one, when the held-out trials came from several machines: as registered
    (a registration from before the machine term; the blocked verdict above is then a declared deviation), or a
    sensitivity (the registration states the machine term, so the blocked verdict above is the registered one)."""
    registered = "as_registered" in holdout
    raw = holdout.get("as_registered") or holdout.get("without_machine_term")
    if not raw or raw.get("status") != "ok":
        return []
    row = next((r for r in raw["rows"] if "ratio" in r), None)
    detail = (
        f"R = {row['ratio']:.2f}, 90 % CI {_interval(row['ci90'])}, 95 % CI {_interval(row['ci95'])}, {row['df']} df"
        if row
        else next((r.get("reason") for r in raw["rows"] if r.get("reason")), "")
    )
    if registered:
        return [
            "**As registered, without a machine term: " + raw["verdict"] + f"** ({detail}). The trials above ran "
            "on several machines and the registered analysis pools them as one; the verdict above fits a machine "
            "term (a declared deviation from the registration).",
            "",
        ]
    return [
        f"Sensitivity, the machines pooled without the registered machine term: {raw['verdict']} ({detail}). The "
        "verdict above, with the machine term, is the registered one.",
        "",
    ]


def machines_markdown(transfer: dict) -> list[str]:
    """Which machines the trials ran on and, where a cell pools several, the machine term fitted there."""
    machines, terms = transfer.get("machines") or [], transfer.get("machine_terms") or []
    if len(machines) < 2 and not terms:
        return []
    lines = [
        "## Machines",
        "",
        f"The trials ran on {len(machines)} machines with different numerics: "
        + "; ".join(machines)
        + ". Where a cell pools them, the analysis fits final_loss ~ lr (a factor) + "
        "machine (the machine term, additive) by least squares and removes each offset before the vertex is "
        "estimated; machine x ln lr is tested where a machine shares >= 3 lrs with the reference.",
        "",
        "| size | batch | machine | trials | offset (95 % CI) | df | machine x ln lr (p) | detectable slope |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for term in terms:
        if term.get("status") != "ok":
            lines.append(
                f"| {term['size']} | {term['batch_size']:g} | {', '.join(term.get('left_out', []))} | - | "
                f"not estimable: left out | - | - | - |"
            )
            continue
        for off in term["offsets"]:
            tilt = off["interaction"]
            inter = (
                (f"{tilt['slope']:+.4f} (p = {tilt['p']:.2g})", f"{tilt['detectable_slope']:.4f}")
                if tilt.get("status") == "ok"
                else (tilt.get("reason", "-"), "-")
            )
            lines.append(
                f"| {term['size']} | {term['batch_size']:g} | {off['machine']} vs {term['reference']} | "
                f"{off['trials']} | {off['offset']:+.4f} {_interval(off['ci'])} | {term['df']} | {inter[0]} | "
                f"{inter[1]} |"
            )
    return lines + [
        "",
        "Detectable slope: the machine x ln lr tilt (nats per unit ln lr) a two-sided 5 % test "
        "finds with 80 % power in this design.",
        "",
    ]


def transfer_markdown(analysis: dict) -> list[str]:
    """Across sizes: the held-out verdict first (the lab's credibility), then noise, optima, the law, literature."""
    # long: a Markdown template, section by section in the order the page reads
    transfer = analysis.get("transfer")
    if not transfer:
        return []
    law = transfer["law"]
    lines = [
        "## Held-out check: can the small sizes forecast the largest?",
        "",
        *verdict_markdown(transfer["holdout"], analysis["options"].get("preregistration")),
        *as_registered_markdown(transfer["holdout"]),
        *machines_markdown(transfer),
        *optima_markdown(transfer),
    ]
    lines += ["", "## The law across sizes", ""]
    if law["status"] != "ok":
        return lines + [f"Not fitted: {law['reason']}.", ""]
    names = ["alpha"] + (["beta"] if law["with_batch"] else [])
    lines += [
        f"`{law['formula']}` on every measured optimum ({law['n_points']} cells, sizes {', '.join(law['sizes'])}; "
        f"{law['estimator']}): "
        + ", ".join(f"{n} = **{law[n]:.3f}** {_interval(law[f'{n}_ci'])}" for n in names)
        + f" ({law['df']} residual df); lack of fit tau = {law['tau']:.3f} in ln lr.",
        "",
    ]
    ransac = transfer.get("ransac") or {}
    if ransac.get("status") == "ok":
        lines += [
            f"Sensitivity check, not the headline: RANSAC on the unweighted vertices gives alpha = "
            f"{ransac['alpha']:.3f} {_interval(ransac['alpha_ci'])} on {ransac['n_inliers']} of "
            f"{ransac['n_points']} cells"
            + (f" (dropped: {', '.join(ransac['dropped'])})" if ransac["dropped"] else " (dropped none)")
            + ".",
            "",
        ]
    if transfer["bounds"]:
        lines += [
            "Left out of the fit (bounds, not measurements): "
            + ", ".join(
                f"{p['size']}/batch {p['batch_size']:g} ({p['status'].replace('_', ' ')})" for p in transfer["bounds"]
            )
            + ".",
            "",
        ]
    lines += [
        "| exponent | this lab | Step Law (Li et al. 2025) | DeepSeek LLM (2024) | muP (Yang et al. 2022) |",
        "|---|---|---|---|---|",
    ]
    published = transfer["published"]
    for name in names:
        others = [published[k].get(name) for k in published]
        lines.append(
            f"| {name} (ln {'N' if name == 'alpha' else 'B, with D = steps x B x seq'}) | {law[name]:.3f} "
            f"{_interval(law[f'{name}_ci'])} | " + " | ".join("-" if v is None else f"{v:+.3f}" for v in others) + " |"
        )
    lines += [
        "",
        "The same lrs evaluated at each cell's N and D (tokens = steps x batch x sequence length):",
        "",
        "| size | N | batch | tokens | measured lr_opt | this lab | Step Law | DeepSeek |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in transfer["literature"]:
        lines.append(
            f"| {r['size']} | {r['n_params']:,.0f} | {r['batch_size']:g} | {short(r['tokens'])} | "
            f"{short(r['measured'])}{'' if r['status'] == 'measured' else ' (bound)'} | {short(r.get('this lab'))} "
            f"| {short(r.get('Step Law (Li et al. 2025)'))} | {short(r.get('DeepSeek LLM (2024)'))} |"
        )
    return lines + [
        "",
        "![lr transfer](plots/lr_transfer.png)",
        "",
        "![loss vs lr per size](plots/loss_vs_lr_sizes.png)",
        "",
    ]


def report_markdown(analysis: dict, plots: list[str]) -> str:
    """The scaling report, section by section in the order the page reads."""
    thresholds = analysis["thresholds"]
    lines = [
        "# lr x batch-size scaling report",
        "",
        *(
            [
                "A scan across training length: every N below is D, a probe's training tokens, and alpha is the "
                f"length law's beta ({_length_line(analysis['length'])}).",
                "",
            ]
            if analysis.get("length")
            else []
        ),
        *transfer_markdown(analysis),
        f"{analysis['n_trials']} trials, {analysis['n_feasible']} feasible. A trial is dropped when it did not "
        f"finish (status other than ok: OOM, crashed, failed), diverged (final loss > "
        f"{short(thresholds['diverged_loss'], 4)} or not finite) or was unstable (early loss std > "
        f"{short(thresholds['unstable_std'], 4)}: {thresholds['unstable_rule']}).",
        "",
        "## Dropped trials",
        "",
    ]
    if analysis["dropped"]:
        lines += ["| trial | lr | batch | reason |", "|---|---|---|---|"]
        lines += [
            f"| {d['trial_id']} | {short(d['lr'])} | {short(d['batch_size'])} | {d['reason']} |"
            for d in analysis["dropped"]
        ]
    else:
        lines.append("None.")
    lines += [*_per_batch_markdown(analysis), *_fits_markdown(analysis)]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}](plots/{Path(p).name})" for p in plots]
    lines += [
        "",
        "## Next step",
        "",
        "`python sweep.py recommend --from THIS_FOLDER --memory-gb 24` turns these fits into a training "
        "config (YAML for `train_pretrain.py --config`).",
        "",
    ]
    return "\n".join(lines)


def _per_batch_markdown(analysis: dict) -> list[str]:
    lines = [
        "",
        "## Best learning rate per batch size",
        "",
        "lr_opt is the vertex of a parabola in ln(lr) through the grid's lowest final loss and its two "
        "neighbours; at the edge of the lr grid it is the grid value itself (widen the grid there).",
        "",
        "| batch | lr_opt | method | grid best lr | best final loss | feasible lrs | in fit |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in analysis["lr_opt_per_batch"]:
        method = point["method"] + (" (at grid edge)" if point["at_edge"] else "")
        used = {True: "yes", False: "outlier (RANSAC)"}.get(
            point.get("inlier"), "no (grid edge)" if point["at_edge"] else "no"
        )
        lines.append(
            f"| {short(point['batch_size'])} | {short(point['lr_opt'])} | {method} | {short(point['grid_lr'])} "
            f"| {short(point['best_final_loss'], 4)} | {point['n_lrs']} | {used} |"
        )
    return lines


def _fits_markdown(analysis: dict) -> list[str]:
    level = f"{analysis['options']['confidence']:.0%}"
    lines = [
        "",
        f"## Fits ({level} bootstrap intervals, RANSAC outlier rejection in log space)",
        "",
        "| fit | estimate | interval | points (inliers) | R^2 (log) |",
        "|---|---|---|---|---|",
    ]
    for name, fit in analysis["fits"].items():
        if fit["status"] != "ok":
            lines.append(f"| {name} | not fitted: {fit['reason']} | | | |")
            continue
        keys = ["k0", "k1", "k2"] if name == "loss_std" else (["a", "b"] if name == "lr_opt" else ["c", "d"])
        estimate = f"{fit['formula']}: " + ", ".join(f"{k} = {short(fit[k])}" for k in keys)
        interval = ", ".join(f"{k} {_interval(fit[f'{k}_ci'])}" for k in keys)
        note = f" ({fit['note']})" if fit.get("note") else ""
        lines.append(
            f"| {name} | {estimate}{note} | {interval} | {fit['n_points']} ({fit['n_inliers']}) "
            f"| {short(fit['r2_log'])} |"
        )
    warning = analysis["fits"]["lr_opt"].get("warning")
    if warning:
        lines += ["", f"**Warning:** {warning}."]
    return lines + [
        "",
        "Intervals come from a residual bootstrap on the RANSAC inliers (scipy.stats.bootstrap, "
        f"{analysis['options']['n_bootstrap']} resamples, widened by t/z for the few points of the lr fit).",
        "Early loss std is the raw std of the first 100 training losses, so it also grows with how fast "
        "the loss falls; the default instability threshold is relative to the sweep's median for that reason.",
    ]


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
    written = [
        path
        for make in (
            _plot_loss_vs_lr,
            _plot_lr_fit,
            _plot_memory_fit,
            _plot_loss_std_fit,
            _plot_transfer,
            _plot_loss_vs_lr_sizes,
        )
        if (path := make(plot_dir, analysis))
    ]
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
        ax.plot(
            [t["lr"] for t in at_batch],
            [t["final_loss"] for t in at_batch],
            "o-",
            color=colour,
            label=f"batch {batch:g}",
        )
    for point in analysis["lr_opt_per_batch"]:
        ax.axvline(point["lr_opt"], color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set(
        xlabel="learning rate",
        ylabel="final loss",
        title="Final loss vs lr" + (f" (size {size})" if size else "") + " (dotted: lr_opt)",
    )
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
    _power_law_plot(
        ax,
        fit,
        np.array([p["batch_size"] for p in points]),
        analysis["options"]["confidence"],
        f"lr_opt = {fit['a']:.3g} * batch^{fit['b']:.3f}",
    )
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
        center, low, high = predict_band(
            fit, np.column_stack([np.log(grid), np.full_like(grid, math.log(batch))]), analysis["options"]["confidence"]
        )
        ax.plot(grid, np.exp(center), color=colour, label=f"batch {batch:g}")
        ax.fill_between(grid, np.exp(low), np.exp(high), color=colour, alpha=0.15)
        mask = np.array([float(t["batch_size"]) == batch for t in used])
        ax.scatter(inv_lr[mask & inliers], ys[mask & inliers], color=colour, zorder=3)
        ax.scatter(inv_lr[mask & ~inliers], ys[mask & ~inliers], color="red", marker="x", zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(
        xlabel="1 / learning rate",
        ylabel="early loss std",
        title=f"Early loss std: ln std = {fit['k0']:.2f} + {fit['k1']:.2f} ln(1/lr) + {fit['k2']:.2f} ln(batch)",
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    _save(fig, plot_dir / "loss_std_fit.png")
    return str(plot_dir / "loss_std_fit.png")


def _plot_transfer(plot_dir: Path, analysis: dict) -> Optional[str]:
    """lr_opt against N: every vertex with its CI, the law fitted without the held-out size with its prediction
    band, and the held-out forecast next to its measurement."""
    import matplotlib.pyplot as plt

    transfer = analysis.get("transfer")
    if not transfer or transfer["law"]["status"] != "ok":
        return None
    holdout, points = transfer["holdout"], transfer["points"]
    shown = holdout["fit"] if holdout.get("status") == "ok" else transfer["law"]
    batches = sorted({p["batch_size"] for p in points})
    ns = np.geomspace(min(p["n_params"] for p in points) / 1.5, max(p["n_params"] for p in points) * 1.5, 40)
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for colour, batch in zip(plt.cm.viridis(np.linspace(0, 0.85, len(batches))), batches):
        lines = [predict(shown, n, batch) for n in ns]
        ax.plot(ns, [f["lr"] for f in lines], color=colour, label=f"law, batch {batch:g}")
        ax.fill_between(ns, [f["pi"][0] for f in lines], [f["pi"][1] for f in lines], color=colour, alpha=0.15)
        for p in (p for p in points if p["batch_size"] == batch):
            if p["status"] == "measured" and p.get("ci"):
                # the interval is drawn apart from the point: the bootstrap's percentile interval is centred on the
                # smoothed bowl's vertex, so the raw vertex can lie outside it (a negative yerr would not plot)
                low, high = p["ci"]
                ax.errorbar(p["n_params"], low, yerr=[[0], [high - low]], fmt="none", ecolor=colour, capsize=3)
                ax.scatter(p["n_params"], p["lr_opt"], color=colour, edgecolor="black", zorder=3)
            elif p.get("lr_opt"):
                ax.scatter(
                    p["n_params"],
                    p["lr_opt"],
                    marker="v" if p["status"] == "below_grid" else "^",
                    color=colour,
                    edgecolor="black",
                    zorder=3,
                )
    if holdout.get("status") == "ok":
        ax.scatter(
            [holdout["n_params"]] * len(holdout["rows"]),
            [r["predicted"] for r in holdout["rows"]],
            marker="*",
            s=160,
            color="red",
            zorder=4,
            label=f"forecast for held-out {holdout['size']}: {holdout['verdict']}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    title = "lr_opt vs N" + (
        " (law fitted without the held-out size; band: 95 % prediction)" if holdout.get("status") == "ok" else ""
    )
    ax.set(xlabel="non-embedding parameters N", ylabel="best learning rate", title=title)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    _save(fig, plot_dir / "lr_transfer.png")
    return str(plot_dir / "lr_transfer.png")


def _plot_loss_vs_lr_sizes(plot_dir: Path, analysis: dict) -> Optional[str]:
    """Seed-mean final loss against lr, one line per size (first batch size), each size's lr_opt marked."""
    import matplotlib.pyplot as plt

    transfer = analysis.get("transfer")
    if not transfer:
        return None
    batch = min(p["batch_size"] for p in transfer["points"])
    feasible = _feasible(analysis)
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for colour, size in zip(plt.cm.plasma(np.linspace(0, 0.85, len(transfer["sizes"]))), transfer["sizes"]):
        trials = [t for t in feasible if str(t.get("size")) == size and float(t["batch_size"]) == batch]
        if not trials:
            continue
        lrs, losses = lr_table(trials)
        ax.errorbar(
            lrs,
            [np.mean(v) for v in losses],
            yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in losses],
            fmt="o-",
            color=colour,
            ms=3,
            capsize=2,
            label=size,
        )
        point = next(p for p in transfer["points"] if p["size"] == size and p["batch_size"] == batch)
        if point["status"] == "measured":
            ax.axvline(point["lr_opt"], color=colour, lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set(
        xlabel="learning rate",
        ylabel="final validation loss (seed mean, bars: seed SD)",
        title=f"Loss vs lr per size, batch {batch:g} (dotted: lr_opt)",
    )
    ax.legend(fontsize=7)
    _save(fig, plot_dir / "loss_vs_lr_sizes.png")
    return str(plot_dir / "loss_vs_lr_sizes.png")
