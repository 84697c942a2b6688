"""The calibrated lab (issue 11): seed replicates, pure-error statistics, new factors, eval scalars, resume."""

import csv
import json

import numpy as np
import pytest

from llmlab.sweep import stats
from llmlab.sweep.design import CONTROL, FACTORS, doe20_design, replicate
from tests.conftest import run_script, sweep_args


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lab_data_cache")


# ------------------------------------------------------------------ statistics on planted data (in-process)
PLANTED = {
    "optimizer": {"adamw": -0.2, "lion": 0.3, "adafactor": -0.1},
    "warmup": {100: 0.08, 500: 0.0, 1000: -0.08},
}  # clip, scheduler, weight decay: no effect at all


def planted_rows(noise_sd: float, seed: int = 0, replicates: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    design = replicate(doe20_design(42), replicates, True, 42)
    rows = []
    for trial in design:
        y = 7.0 + sum(PLANTED[f][trial[f]] for f in PLANTED) + rng.normal(0, noise_sd)
        rows.append({**trial, "status": "ok", "final_loss": y})
    return rows


ORDER = {k: list(v) for k, v in FACTORS.items()}


def test_treatment_contrasts_recover_planted_effects_and_holm_keeps_zero_effects_within_noise():
    rows = planted_rows(noise_sd=0.02)
    fitted = stats.fit_effects(rows, list(FACTORS), CONTROL, "final_loss", ORDER)
    assert fitted["noise"]["source"].startswith("residual") and fitted["noise"]["df"] == 60 - 11
    assert fitted["noise"]["pure_error"]["df"] == 40
    contrasts = {(c["factor"], c["level"]): c for c in fitted["contrasts"]}
    assert all(c["reference"] == str(CONTROL[c["factor"]]) for c in fitted["contrasts"])
    for factor, levels in PLANTED.items():
        reference = PLANTED[factor][CONTROL[factor]]
        for level, truth in levels.items():
            if level == CONTROL[factor]:
                continue
            c = contrasts[(factor, str(level))]
            assert (
                np.sign(c["effect"]) == np.sign(truth - reference)
                and abs(c["effect"] - (truth - reference)) < 3 * c["se"]
            )
            assert c["verdict"] == "resolved" and c["p_holm"] >= c["p_value"]
    for factor in ("scheduler", "clip", "weight_decay"):  # planted zero effects stay within noise after Holm
        assert all(c["verdict"] == "within noise" for c in fitted["contrasts"] if c["factor"] == factor)
    tests = {f["factor"]: f for f in stats.factor_tests(fitted)}
    assert tests["optimizer"]["verdict"] == tests["warmup"]["verdict"] == "resolved"
    assert all(tests[f]["verdict"] == "within noise" for f in ("scheduler", "clip", "weight_decay"))
    shares = stats.variance_shares(rows, list(FACTORS), ["final_loss"], CONTROL, ORDER)["final_loss"]
    total_ss = float(
        np.sum((np.array([r["final_loss"] for r in rows]) - np.mean([r["final_loss"] for r in rows])) ** 2)
    )
    assert shares["optimizer"] > 0.5 and shares["clip"] < 0.02 and abs(sum(shares.values()) - 1) < 1e-9
    assert shares["residual"] == pytest.approx(fitted["fit"].ssr / total_ss)


def test_holm_is_statsmodels_without_its_forced_garbage_collection(monkeypatch):
    """statsmodels' Holm runs gc.collect() on every call (0.56 s in a process holding torch and transformers):
    llmlab's holm gives statsmodels' numbers, makes no collection, and leaves gc.collect as it found it."""
    import gc

    from statsmodels.stats.multitest import multipletests

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a, **k: calls.append(1) or 0)
    p_values = [0.001, 0.04, 0.03, 0.2, 0.012]
    assert stats.holm(p_values) == [float(p) for p in multipletests(p_values, alpha=0.05, method="holm")[1]]
    assert len(calls) == 1  # statsmodels' own call just above; none from llmlab's
    assert stats.holm(p_values) == pytest.approx([0.005, 0.09, 0.09, 0.2, 0.048]) and len(calls) == 1
    gc.collect()
    assert len(calls) == 2  # restored: the patched collect counts again


def test_holm_controls_the_family_when_nothing_is_planted():
    """Ten contrasts of pure noise: uncorrected, about 40 % of data sets show a 'resolved' one; with Holm <= ~5 %."""
    flagged_raw, flagged_holm = [], []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        rows = [{**r, "final_loss": 7.0 + rng.normal(0, 0.05)} for r in planted_rows(0.0, seed, replicates=2)]
        contrasts = stats.fit_effects(rows, list(FACTORS), CONTROL, "final_loss", ORDER)["contrasts"]
        flagged_raw.append(any(c["p_value"] < 0.05 for c in contrasts))
        flagged_holm.append(any(c["verdict"] == "resolved" for c in contrasts))
    assert np.mean(flagged_holm) <= 0.125 and np.mean(flagged_raw) > np.mean(flagged_holm)


def test_effect_intervals_cover_the_truth_95_percent_of_the_time():
    covered = []
    truth = PLANTED["optimizer"]["lion"] - PLANTED["optimizer"]["adamw"]
    for seed in range(60):
        rows = planted_rows(noise_sd=0.05, seed=seed, replicates=2)
        contrast = next(
            c
            for c in stats.fit_effects(rows, list(FACTORS), CONTROL, "final_loss", ORDER)["contrasts"]
            if c["factor"] == "optimizer" and c["level"] == "lion"
        )
        covered.append(contrast["ci_low"] <= truth <= contrast["ci_high"])
    assert 0.88 <= np.mean(covered) <= 1.0  # binomial(60, 0.95): 0.88 is ~2.5 sd below


def test_noise_floor_and_replicates_needed_use_t_with_the_sd_df():
    rows = planted_rows(noise_sd=0.05, seed=1)
    floor = stats.pure_error(rows, "final_loss")
    assert floor["df"] == 40 and floor["ci"][0] < 0.05 < floor["ci"][1]
    # 2 ((t_0.975,40 + t_0.80,40) x 0.05 / 0.05)^2 = 2 (2.021 + 0.851)^2 = 16.5 -> 17 (z would give 16)
    assert stats.replicates_needed(0.05, 40) == 17 and stats.replicates_needed(None, 0) is None
    assert stats.replicates_needed(0.05, 2) > stats.replicates_needed(0.05, 40)  # few df: more runs
    without = stats.pure_error([{**r, "point": r["trial_id"]} for r in rows if r["replicate"] == 0], "final_loss")
    assert without["sd"] is None and without["df"] == 0


def test_replicates_add_seeds_for_the_reference_only_unless_asked():
    design = replicate(doe20_design(42), 3, False, 42)
    assert [t["trial_id"] for t in design[:4]] == ["control", "control-r1", "control-r2", "t01"]
    assert [t["seed"] for t in design[:4]] == [42, 43, 44, 42]
    assert {t["point"] for t in design[:3]} == {"control"} and len(design) == 22
    everything = replicate(doe20_design(42), 2, True, 7)
    assert len(everything) == 40 and all(t["seed"] in (7, 8) for t in everything)


# ------------------------------------------------------------------ real processes at the smoke budget
GRID = """\
replicates: 2
trials:
  - {trial_id: control}
  - {trial_id: same_a, seed: 7}
  - {trial_id: same_b, seed: 7}
  - {trial_id: learned, position_encoding: learned, seed: 8}
  - {trial_id: sinus, position_encoding: sinusoidal}
  - {trial_id: valueclip, clip_mode: value, clip: 0.05}
  - {trial_id: smooth, label_smoothing: 0.1, lr: 0.003}
  - {trial_id: bigbatch, batch_size: 4}
"""


@pytest.fixture(scope="module")
def lab_grid_run(tmp_path_factory, data_cache):
    folder = tmp_path_factory.mktemp("lab")
    grid = folder / "grid.yaml"
    grid.write_text(GRID)
    out = folder / "out"
    proc = run_script(sweep_args(out, data_cache, "--workers", "2", grid=grid), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, grid, out, proc


@pytest.mark.slow
def test_yaml_grid_with_seeds_replicates_and_every_new_factor(lab_grid_run):
    _, _, out, _ = lab_grid_run
    rows = {r["trial_id"]: r for r in read_csv(out / "results.csv")}
    assert set(rows) == {
        "control",
        "control-r1",
        "same_a",
        "same_b",
        "learned",
        "sinus",
        "valueclip",
        "smooth",
        "bigbatch",
    }
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert (rows["control"]["seed"], rows["control-r1"]["seed"], rows["control-r1"]["replicate"]) == ("42", "43", "1")
    # same seed and settings reproduce exactly; another seed gives another run
    assert rows["same_a"]["final_loss"] == rows["same_b"]["final_loss"]
    assert rows["control"]["final_loss"] != rows["control-r1"]["final_loss"]
    assert rows["learned"]["position_encoding"] == "learned" and rows["sinus"]["position_encoding"] == "sinusoidal"
    assert rows["valueclip"]["clip_mode"] == "value" and int(rows["valueclip"]["clipped_steps"]) > 0
    assert rows["smooth"]["label_smoothing"] == "0.1" and rows["bigbatch"]["accumulation_steps"] == "2"
    report = (out / "report.md").read_text()
    assert report.index("## Calibration: the noise floor") < report.index("## Design")
    assert "seed SD" in report and "Runs per configuration to detect 0.05 nats" in report
    assert "## Sensitivity map" in report and (out / "plots" / "sensitivity.png").stat().st_size > 10_000


@pytest.mark.slow
def test_finished_trial_has_eval_scalars_in_tensorboard(lab_grid_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, out, _ = lab_grid_run
    result = json.loads((out / "trials" / "sinus" / "result.json").read_text())
    acc = EventAccumulator(str(out / "trials" / "sinus" / "tensorboard")).Reload()
    assert {"eval/loss", "eval/perplexity"} <= set(acc.Tags()["scalars"])
    assert acc.Scalars("eval/loss")[-1].value == pytest.approx(result["final_loss"], rel=1e-6)


@pytest.mark.slow
def test_resume_with_more_replicates_runs_only_the_new_seeds(lab_grid_run, data_cache):
    folder, grid, out, _ = lab_grid_run
    before = {p.parent.name: p.stat().st_mtime_ns for p in (out / "trials").glob("*/result.json")}
    proc = run_script(sweep_args(out, data_cache, "--replicates", "3", grid=grid), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming: 9 finished trial(s) skipped" in proc.stdout and "; 1 to run" in proc.stdout
    after = {p.parent.name: p.stat().st_mtime_ns for p in (out / "trials").glob("*/result.json")}
    assert set(after) - set(before) == {"control-r2"}
    assert all(after[t] == mtime for t, mtime in before.items())  # nothing ran twice
    again = run_script(sweep_args(out, data_cache, "--replicates", "3", grid=grid), timeout=600)
    assert again.returncode == 0 and "; 0 to run" in again.stdout


def test_bad_replication_settings_are_one_line_errors(tmp_path, data_cache):
    for text, needle in (
        ("replicates: 0\ntrials: [{optimizer: adamw}]\n", "replicates = 0 is invalid"),
        ("replicate_all: 3\ntrials: [{optimizer: adamw}]\n", "replicate_all must be true or false"),
        ("trials: [{clip_mode: value, clip: adaptive}]\n", "clip_mode value needs a number clip"),
        ("trials: [{position_encoding: alibi}]\n", "position_encoding = 'alibi' is invalid"),
    ):
        grid = tmp_path / "bad.yaml"
        grid.write_text(text)
        proc = run_script(sweep_args(tmp_path / "out", data_cache, grid=grid))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]


def test_the_resume_fingerprint_ignores_exactly_the_options_declared_outcome_false():
    """A new option says itself whether it changes results (opt(..., outcome=False)); no list elsewhere to edit."""
    from dataclasses import fields, replace

    from llmlab.sweep.config import SweepConfig
    from llmlab.sweep.runner import settings_fingerprint

    base = SweepConfig()
    neutral = {
        "workers": 2,
        "launcher": "spawn",
        "ray_address": "10.0.0.1:6379",
        "node_retries": 5,
        "trial_timeout": 99,
        "threads_per_worker": 1,
        "output_dir": "elsewhere",
    }
    assert {f.name for f in fields(SweepConfig) if f.metadata.get("outcome") is False} >= set(neutral)
    assert settings_fingerprint(replace(base, **neutral)) == settings_fingerprint(base)
    for changed in ({"seed": 7}, {"label_smoothing": 0.1}, {"budget": "smoke"}):
        assert settings_fingerprint(replace(base, **changed)) != settings_fingerprint(base), changed


def test_a_size_scan_may_grow_by_later_sizes_and_a_held_out_check_but_not_change_what_ran(tmp_path):
    """Fit sizes first, then the held-out size with its registered design: the resume fingerprint leaves the
    growth options out (for size scans only), and check_growth refuses every change to what already ran."""
    from dataclasses import replace

    from llmlab.core.errors import UserError
    from llmlab.scaling.scan import PREREGISTRATION, check_growth, grow_seeds, study_for
    from llmlab.sweep.config import SweepConfig
    from llmlab.sweep.runner import settings_fingerprint

    fingerprint = lambda c, **k: settings_fingerprint(c, study=study_for(c), **k)  # noqa: E731  as sweep.py runs it
    fit = SweepConfig(grid="lr_bs", sizes=["64x2", "96x3", "128x4"], holdout="none")
    grown = replace(fit, sizes=fit.sizes + ["192x6"], holdout="largest", holdout_replicates=6)
    assert fingerprint(grown) == fingerprint(fit)
    assert fingerprint(grown, before_growth=True) != fingerprint(fit, before_growth=True)
    assert fingerprint(replace(fit, lr_points=5)) != fingerprint(fit)  # grids stay fixed
    doe = SweepConfig(grid="doe20")
    assert fingerprint(replace(doe, sizes=["64x2"])) != fingerprint(doe)

    plan = {"sizes": ["64x2", "96x3", "128x4"], "held_out": None, "cells": [{"size": s} for s in fit.sizes]}
    check_growth(plan, fit.sizes + ["192x6"], "192x6", tmp_path)  # adds a size and holds it out: fine
    with pytest.raises(UserError, match="add sizes after them, not change them"):
        check_growth(plan, ["64x2", "128x4", "192x6"], "192x6", tmp_path)
    with pytest.raises(UserError, match="already ran as a fit size"):
        check_growth(plan, fit.sizes, "128x4", tmp_path)
    (tmp_path / PREREGISTRATION).write_text("{}")
    plan.update(sizes=fit.sizes + ["192x6"], held_out="192x6")
    with pytest.raises(UserError, match="registered its check on 192x6"):
        check_growth(plan, fit.sizes + ["192x6", "256x8"], "256x8", tmp_path)
    cells = [{"size": "64x2", "seeds": 3}, {"size": "192x6", "seeds": 6}]
    grow_seeds({"cells": cells}, "192x6", 5)  # more fit seeds as whole blocks; the held-out cell keeps its count
    assert [c["seeds"] for c in cells] == [5, 6]
    grow_seeds({"cells": cells}, "192x6", 2)  # never fewer
    assert [c["seeds"] for c in cells] == [5, 6]
