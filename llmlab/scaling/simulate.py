"""The held-out check's error rates, by simulating the whole pipeline: synthetic scans through the real estimator.

A simulated scan plants a true law ln lr_opt = k0 + alpha ln N and a parabola in ln lr at every size (curvature and
seed SD per size from measurements), centres each fit size's grid on the truth times a centring error (the real
scan centres on a running forecast), extends grids with the scan's own rule (optimum.grid_extension), then runs the
same code the report runs: seed_noise -> size_points -> fit_law on the fit sizes -> predict the held-out size, whose
grid is centred on that forecast and whose true optimum is off the law by the planted miss -> decide. Counting the
verdicts over many scans gives P(within | exact), P(failed | 1.5x and 2x miss), P(a wrong call | exact) and the
power that a design reaches, which is how the scan's design is chosen (bench/forecast_design.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from llmlab.scaling.law import fit_law, predict
from llmlab.scaling.optimum import cell_optimum, grid_extension
from llmlab.scaling.transfer import BAND, decide, flat_forecast, flat_verdict, seed_noise, sigma_model, size_points

MISSES = {"exact": 1.0, "1.5x": 1.5, "2x": 2.0}


@dataclass(frozen=True)
class Design:
    fit_sizes: tuple[str, ...]
    held_out: str
    fit_lrs: int = 5
    fit_seeds: int = 5
    held_lrs: int = 7
    held_seeds: int = 2
    step: float = 2**0.5
    max_extensions: int = 3

    def trials(self) -> int:
        """Planned trials before any extension."""
        return len(self.fit_sizes) * self.fit_lrs * self.fit_seeds + self.held_lrs * self.held_seeds


@dataclass(frozen=True)
class Truth:
    """The world a simulated scan measures: N, curvature (nats per (ln lr)^2) and seed SD of every size."""

    n_params: dict[str, float]
    curvature: dict[str, float]
    sigma: dict[str, float]
    alpha: float = -0.47
    lr_at: tuple[float, float] = (1.65e-3, 410400.0)  # (lr_opt, N) through which the law passes
    centring_sd: float = 0.3  # ln-lr error of the running forecast a fit size's grid is centred on
    noise_lr_slope: float = 0.0  # d ln sigma^2 / d ln lr about each size's optimum
    # SD of each size's true ln lr_opt about the power law (its lack of fit, tau): a real family is not an exact
    # line, and a forecast is judged against the held-out size's own optimum, off the line by as much
    law_scatter_sd: float = 0.0
    extra: dict = field(default_factory=dict)

    def ln_lr_opt(self, size: str) -> float:
        return math.log(self.lr_at[0]) + self.alpha * math.log(self.n_params[size] / self.lr_at[1])


def _grid(centre: float, points: int, step: float) -> list[float]:
    return [centre * step ** (k - (points - 1) / 2) for k in range(points)]


def _trials(rng, truth: Truth, size: str, lrs, seeds: int, ln_opt: float) -> list[dict]:
    rows = []
    for lr in lrs:
        offset = math.log(lr) - ln_opt
        sd = truth.sigma[size] * math.exp(truth.noise_lr_slope / 2 * offset)
        for _ in range(seeds):
            rows.append(
                {
                    "size": size,
                    "batch_size": 4.0,
                    "lr": float(lr),
                    "n_params": truth.n_params[size],
                    "final_loss": 6.5 + truth.curvature[size] * offset**2 + rng.normal(0.0, sd),
                    "initial_loss": 10.8,
                    "train_tokens": 1.0,
                }
            )
    return rows


def _measure_size(
    rng, truth: Truth, design: Design, size: str, centre: float, ln_opt: float, points: int, seeds: int
) -> list[dict]:
    """One size's trials, with the scan's extension rule applied until it asks for nothing more."""
    lrs = _grid(centre, points, design.step)
    rows = _trials(rng, truth, size, lrs, seeds, ln_opt)
    for _ in range(design.max_extensions):
        noise = seed_noise(rows)
        status = cell_optimum(rows, sigma_model(noise, size))["status"]
        means = [float(np.mean([r["final_loss"] for r in rows if r["lr"] == lr])) for lr in sorted(lrs)]
        new = grid_extension(sorted(lrs), means, status, design.step)
        if not new:
            break
        lrs += new
        rows += _trials(rng, truth, size, new, seeds, ln_opt)
    return rows


def simulate_once(rng, truth: Truth, design: Design, miss: float) -> dict:
    """One whole scan; its verdict and ln R (None when the held-out size was not a measurement)."""
    rows: list[dict] = []
    sizes = (*design.fit_sizes, design.held_out)
    # drawn only when planted, so a world without scatter replays the same scans as before it existed
    offsets = rng.normal(0.0, truth.law_scatter_sd, len(sizes)) if truth.law_scatter_sd else np.zeros(len(sizes))
    scatter = dict(zip(sizes, offsets.tolist()))
    for size in design.fit_sizes:
        ln_opt = truth.ln_lr_opt(size) + scatter[size]
        centre = math.exp(ln_opt + rng.normal(0.0, truth.centring_sd))
        rows += _measure_size(rng, truth, design, size, centre, ln_opt, design.fit_lrs, design.fit_seeds)
    fit_points = [p for p in size_points(rows, seed_noise(rows)) if p["status"] == "measured"]
    law = fit_law(fit_points, with_batch=False)
    if law["status"] != "ok":
        return {"verdict": "no law", "ln_r": None}
    forecast = predict(law, truth.n_params[design.held_out], 4.0)
    # forecast / measured = miss: the held-out optimum sits 1/miss off the true law, the grid on the forecast
    ln_held = truth.ln_lr_opt(design.held_out) + scatter[design.held_out] - math.log(miss)
    held_rows = _measure_size(
        rng, truth, design, design.held_out, forecast["lr"], ln_held, design.held_lrs, design.held_seeds
    )
    held = size_points(held_rows, seed_noise(rows + held_rows))[0]
    if held["status"] != "measured":
        return {"verdict": "undecided", "ln_r": None, "held_status": held["status"]}
    ln_r = forecast["ln_lr"] - held["ln_lr_opt"]
    flat = flat_forecast(fit_points)
    return {
        **decide(ln_r, math.sqrt(forecast["se_mean"] ** 2 + held["var_ln"]), law["df"]),
        "ln_r": ln_r,
        "flat": flat_verdict(flat, held) if flat["status"] == "ok" else None,
    }


def operating_characteristics(truth: Truth, design: Design, reps: int = 200, seed: int = 0) -> dict:
    """Verdict frequencies at an exact forecast and at 1.5x and 2x misses (half too high, half too low)."""
    rng = np.random.default_rng(seed)
    out: dict = {"design": asdict(design), "trials": design.trials(), "reps": reps}
    within = f"within {BAND:g}x"
    for name, miss in MISSES.items():
        verdicts, detected, flat_verdicts, flat_detected = [], 0, [], 0
        for rep in range(reps):
            factor = miss if rep % 2 == 0 else 1 / miss
            result = simulate_once(rng, truth, design, factor)
            verdicts.append(result["verdict"])
            ci = result.get("ci95")
            detected += bool(ci and (ci[0] > 1 or ci[1] < 1))
            # muP's flat prediction, judged on the same scans (its misses are the planted ones where alpha is 0)
            flat = result.get("flat") or {}
            flat_verdicts.append(flat.get("verdict"))
            flat_detected += bool(flat and (flat["ci95"][0] > 1 or flat["ci95"][1] < 1))
        out[name] = {
            "within": verdicts.count(within) / reps,
            "failed": verdicts.count("failed") / reps,
            "undecided": verdicts.count("undecided") / reps,
            "ci_excludes_1": detected / reps,
            "no_law": verdicts.count("no law") / reps,
            "flat_within": flat_verdicts.count(within) / reps,
            "flat_ci_excludes_1": flat_detected / reps,
        }
    out["summary"] = {
        "P(within | exact)": out["exact"]["within"],
        "P(failed | exact)": out["exact"]["failed"],
        "P(failed | 1.5x miss)": out["1.5x"]["failed"],
        "P(failed | 2x miss)": out["2x"]["failed"],
        "power: P(95 % CI excludes 1 | 1.5x miss)": out["1.5x"]["ci_excludes_1"],
        "P(within | 1.5x miss)": out["1.5x"]["within"],
    }
    if truth.alpha == 0:  # only where the world is flat is the flat prediction's miss the planted one
        out["summary"] |= {
            "flat: P(within | exact)": out["exact"]["flat_within"],
            "flat: P(95 % CI excludes 1 | 1.5x miss)": out["1.5x"]["flat_ci_excludes_1"],
        }
    return out
