"""The machine term of an analysis that pools blocks run on different CPUs.

A scan runs in blocks (llmlab.scaling.scan); a new machine whose replay of a finished trial is not bit-identical starts
new blocks, and its trials carry its label. Per (size, batch) cell the analysis then fits

    final_loss ~ lr (a factor: one mean per scanned lr) + machine (additive, the first machine is the reference)

by least squares and subtracts each machine's offset from its trials, so the vertex estimator sees one machine's
curve. Where a machine shares at least three lrs with the reference, the model also gets machine x (ln lr - its mean)
and its t test, with the slope the design could have detected (80 % power, two-sided 5 %): a tilt of that size
would move the vertex, and an additive term cannot remove it.

Each adjusted trial carries `seed_weight`: the share of a seed its lr's adjusted mean is worth once the offset's own
uncertainty is counted (Var(lr mean) from the model's covariance), which the vertex's bootstrap uses in place of
the plain seed count.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy import stats

# what a pre-registration states about trials from several machines (llmlab.scaling.scan.preregister): registered, the
# blocked verdict is the registered one and the pooled verdict a sensitivity, not the other way round
MACHINE_RULE = (
    "per (size, batch) cell whose trials ran on machines with different numerics: final_loss ~ lr (one mean per "
    "lr) + machine (additive; the first machine the scan met is the reference), by least squares; each offset is "
    "removed before the vertex, and each lr's seed weight counts the offsets' uncertainty; a machine sharing no lr "
    "with the reference is left out of that cell"
)


def machine_of(row: dict) -> str:
    """The numerics a trial ran with: the scan's group (machines that replay bit-identically share one), else
    its CPU."""
    return str(row.get("machine") or row.get("cpu") or "unknown")


def machine_adjust(feasible: list[dict], order: Optional[list[str]] = None) -> tuple[list[dict], list[dict]]:
    """Rows with each cell's machine offsets removed, and one record per cell that pools machines (its offsets with
    CIs and df, the interaction test, the df the offsets cost the seed noise). Cells of one machine pass unchanged.
    `order`: machines in the order the scan met them (its first is the reference)."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for row in feasible:
        cells.setdefault((str(row.get("size")), float(row["batch_size"])), []).append(row)
    adjusted, terms = [], []
    for (size, batch), trials in cells.items():
        seen = sorted(
            {machine_of(r) for r in trials},
            key=lambda m: (order.index(m) if order and m in order else len(order or []), m),
        )
        if len(seen) == 1:
            adjusted += trials
            continue
        rows, term = _adjust_cell(trials, seen)
        adjusted += rows
        terms.append({"size": size, "batch_size": batch, **term})
    return adjusted, terms


def _design(trials: list[dict], machines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lrs = np.array(sorted({float(r["lr"]) for r in trials}))
    lr_index = np.array([int(np.searchsorted(lrs, float(r["lr"]))) for r in trials])
    X = np.zeros((len(trials), len(lrs) + len(machines) - 1))
    X[np.arange(len(trials)), lr_index] = 1.0
    for j, machine in enumerate(machines[1:]):
        X[:, len(lrs) + j] = [machine_of(r) == machine for r in trials]
    return X, lrs, lr_index


def _adjust_cell(trials: list[dict], machines: list[str]) -> tuple[list[dict], dict]:
    # a machine that shares no lr with the others has an offset confounded with those lrs' means: leave it out
    shared = {m: {float(r["lr"]) for r in trials if machine_of(r) == m} for m in machines}
    reference_lrs = shared[machines[0]]
    dropped = [m for m in machines[1:] if len(shared[m] & reference_lrs) == 0]
    machines = [m for m in machines if m not in dropped]
    trials = [r for r in trials if machine_of(r) in machines]
    if len(machines) == 1:
        return trials, {"status": "not_estimable", "reference": machines[0], "left_out": dropped, "lost_df": 0}
    X, lrs, lr_index = _design(trials, machines)
    y = np.array([float(r["final_loss"]) for r in trials])
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    df = len(y) - X.shape[1]
    if df < 1:
        return [r for r in trials if machine_of(r) == machines[0]], {
            "status": "not_estimable",
            "reference": machines[0],
            "left_out": machines[1:],
            "lost_df": 0,
            "reason": "no residual df to put an interval on the offsets",
        }
    sigma = math.sqrt(float(np.sum((y - X @ beta) ** 2)) / df)
    cov = sigma**2 * np.linalg.inv(X.T @ X)
    term = {
        "status": "ok",
        "reference": machines[0],
        "left_out": dropped,
        "df": df,
        "sigma": sigma,
        "lost_df": len(machines) - 1,
        "offsets": [],
    }
    offsets = {machines[0]: 0.0}
    for j, machine in enumerate(machines[1:]):
        k = len(lrs) + j
        offsets[machine] = float(beta[k])
        record = _offset(beta[k], math.sqrt(cov[k, k]), df)
        record.update(
            machine=machine,
            trials=int(X[:, k].sum()),
            shared_lrs=len(shared[machine] & reference_lrs),
            interaction=_interaction(X, y, lrs, lr_index, k),
        )
        term["offsets"].append(record)
    # each lr mean's variance against sigma^2 / seeds: equal without machines, larger once an offset was estimated
    lr_var = np.diag(cov)[: len(lrs)]
    counts = np.bincount(lr_index, minlength=len(lrs)).astype(float)
    weight = np.minimum(1.0, sigma**2 / counts / np.where(lr_var > 0, lr_var, np.inf))
    rows = [
        {
            **row,
            "final_loss": float(row["final_loss"]) - offsets[machine_of(row)],
            "raw_final_loss": float(row["final_loss"]),
            "seed_weight": float(weight[i]),
        }
        for row, i in zip(trials, lr_index)
    ]
    return rows, term


def _offset(estimate: float, se: float, df: int) -> dict:
    t95 = stats.t.ppf(0.975, df)
    return {
        "offset": float(estimate),
        "se": se,
        "ci": [float(estimate - t95 * se), float(estimate + t95 * se)],
        "p": float(2 * stats.t.sf(abs(estimate) / se, df)) if se > 0 else None,
    }


def _interaction(X: np.ndarray, y: np.ndarray, lrs: np.ndarray, lr_index: np.ndarray, column: int) -> dict:
    """machine x ln lr for one machine's dummy column: its slope (nats per unit ln lr), t test and the slope an 80 %
    powered two-sided 5 % test could have detected; unavailable where the machine shares fewer than 3 lrs."""
    mine = X[:, column] == 1
    x = np.log(lrs)[lr_index]
    common = set(lr_index[mine]) & set(lr_index[~mine])
    if len(common) < 3:
        return {"status": "unavailable", "reason": f"{len(common)} lrs shared with the reference (needs 3)"}
    tilt = np.where(mine, x - x[mine].mean(), 0.0)
    Xi = np.column_stack([X, tilt])
    beta, *_ = np.linalg.lstsq(Xi, y, rcond=None)
    df = len(y) - Xi.shape[1]
    if df < 1:
        return {"status": "unavailable", "reason": "no residual df"}
    sigma2 = float(np.sum((y - Xi @ beta) ** 2)) / df
    se = math.sqrt(sigma2 * np.linalg.inv(Xi.T @ Xi)[-1, -1])
    detectable = (stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) * se
    return {
        "status": "ok",
        "slope": float(beta[-1]),
        "se": se,
        "df": df,
        "p": float(2 * stats.t.sf(abs(beta[-1]) / se, df)),
        "detectable_slope": float(detectable),
    }
