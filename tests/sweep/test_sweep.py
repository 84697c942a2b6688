"""sweep.py end to end on real processes: smoke doe20, a SIGKILLed worker, resume, fail-safes, bad grids."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json
from llmlab.sweep.config import BUDGETS
from llmlab.sweep.design import (
    CONTROL,
    FACTORS,
    balance_design,
    doe20_design,
    grid_from_yaml,
    latin_hypercube_levels,
    level_counts,
    lr_bs_design,
)
from tests.conftest import REPO, run_script, sweep_args, tiny_trial
from tests.sweep.conftest import read_csv


def write_grid(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ design (fast, in-process)
def test_doe20_is_control_plus_balanced_unique_points():
    design = doe20_design(42)
    assert len(design) == 20 and design[0] == {"trial_id": "control", **CONTROL}
    names = list(FACTORS)
    points = [[FACTORS[n].index(t[n]) for n in names] for t in design]
    assert level_counts(points, 5).min() >= 6
    assert len({tuple(p) for p in points}) == 20
    assert doe20_design(42) == design  # seeded


def test_balance_repair_fixes_a_deficient_latin_hypercube():
    raw = latin_hypercube_levels(19, 5, seed=0)  # this seed leaves a level with only 5 runs
    control = [1, 1, 1, 2, 0]
    assert level_counts([control] + raw, 5).min() < 6
    repaired = balance_design([control] + raw)
    assert repaired[0] == control and level_counts(repaired, 5).min() >= 6
    changed = sum(a != b for p, q in zip(repaired[1:], raw) for a, b in zip(p, q))
    assert 1 <= changed <= 3  # minimal repair, not a redraw
    lopsided = balance_design([[0, 0]] * 20)  # worst case: every run on level 0
    assert level_counts(lopsided, 2).min() >= 6 and lopsided[0] == [0, 0]
    for seed in range(15):
        design = doe20_design(seed)
        points = [[FACTORS[n].index(t[n]) for n in FACTORS] for t in design]
        assert level_counts(points, 5).min() >= 6 and len({tuple(p) for p in points}) == 20


def test_lr_bs_grid_and_yaml_grids(tmp_path):
    grid = lr_bs_design([1e-4, 1e-3], [8, 16])
    assert [(t["lr"], t["batch_size"]) for t in grid] == [(1e-4, 8), (1e-3, 8), (1e-4, 16), (1e-3, 16)]
    explicit, settings = grid_from_yaml(
        write_grid(tmp_path / "e.yaml", "trials:\n  - {optimizer: lion}\n  - {trial_id: x, clip: adaptive}\n")
    )
    assert settings == {}
    assert explicit[0] == {"trial_id": "g01", **{**CONTROL, "optimizer": "lion"}} and explicit[1]["clip"] == "adaptive"
    factorial, _ = grid_from_yaml(
        write_grid(tmp_path / "f.yaml", "factorial:\n  optimizer: [adamw, lion]\n  warmup: [100, 500, 1000]\n")
    )
    assert len(factorial) == 6 and {(t["optimizer"], t["warmup"]) for t in factorial} == {
        (o, w) for o in ("adamw", "lion") for w in (100, 500, 1000)
    }


@pytest.mark.parametrize(
    "text,needle",
    [
        ("trials: [{optimizer: sgd}]", "optimizer = 'sgd' is invalid"),
        ("trials: [{learning_rate: 0.1}]", "unknown key(s) learning_rate"),
        ("trials: []", "non-empty list"),
        ("factorial: {clip: 1.0}", "non-empty list"),
        ("factorial: {clip: [-1]}", "clip = -1 is invalid"),
        ("trials: [{warmup: 1.5}]", "warmup = 1.5 is invalid"),
        ("grid: [1, 2]", "exactly one of"),
        ("trials: [{trial_id: a}, {trial_id: a}]", "used more than once"),
        ("trials: [unclosed", "not valid YAML"),
    ],
)
def test_bad_grid_files_are_one_line_errors(tmp_path, text, needle):
    with pytest.raises(UserError, match=None) as err:
        grid_from_yaml(write_grid(tmp_path / "bad.yaml", text))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_grid_on_the_command_line(tmp_path):
    for grid, needle in (
        (write_grid(tmp_path / "bad.yaml", "trials: [{optimizer: sgd}]"), "optimizer = 'sgd'"),
        (str(tmp_path / "missing.yaml"), "not found"),
        ("doe99", "neither a known grid"),
    ):
        proc = run_script(sweep_args(tmp_path / "out", tmp_path / "cache", "--grid", grid))
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]
        assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ end to end (real processes)
@pytest.mark.slow
def test_smoke_doe20_end_to_end(smoke_doe20):
    out, proc = smoke_doe20
    assert "3,282,304 trainable" in proc.stdout  # the smoke budget's 64x2, printed at start (embedding trains)
    assert proc.stdout.index("| control | cosine | 1.0 | 500 | 0.01 | adamw |") < proc.stdout.index("sweep done")
    rows = read_csv(out / "results.csv")
    assert len(rows) == 25 and {r["status"] for r in rows} == {"ok"}  # 19 points + the control 6 times
    for row in rows:
        for key in (
            "final_loss",
            "val_perplexity",
            "stability_index",
            "attention_entropy_last_layer",
            "update_ratio_mean",
            "grad_norm_mean",
            "grad_norm_std",
            "peak_memory_mb",
            "wall_time_s",
            "initial_loss_slope",
            "early_loss_std",
            "time_per_step_s",
            "val_loss_pos_2-8",
            "val_loss_pos_25-32",
        ):
            assert row[key] not in ("", "None"), (row["trial_id"], key)
        assert 5 < float(row["final_loss"]) < 12
    control = next(r for r in rows if r["trial_id"] == "control")
    assert float(control["delta_loss"]) == 0.0
    report = (out / "report.md").read_text()
    for section in (
        "## Design",
        "## Effects on final loss",
        "## Two-factor interactions",
        "## Verdict: effective gain",
        "plots/loss_curves.png",
    ):
        assert section in report
    assert report.count("| t") >= 19
    smoke = BUDGETS["smoke"]
    train = np.load(out / "data" / "train.npy").ravel()
    rows_scored = np.load(out / "data" / "validation.npy")[: smoke.eval_batches * smoke.batch_size].ravel()
    counts = np.bincount(train, minlength=50257) + 1.0
    unigram = -np.log(counts[rows_scored] / counts.sum()).mean()
    stated = re.search(r"unigram model of the training split ([0-9.]+) nats", report)
    assert stated and float(stated.group(1)) == pytest.approx(unigram, abs=0.006), report[:600]
    for plot in ("loss_curves.png", "main_effects.png"):
        assert (out / "plots" / plot).stat().st_size > 10_000
    design = json.loads((out / "design.json").read_text())
    assert len(design) == 25 and [t["seed"] for t in design[:6]] == [42, 43, 44, 45, 46, 47]
    # TensorBoard: curves and an HParams record in every trial's run folder
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "trials" / "t07" / "tensorboard")).Reload()
    assert "train/loss" in acc.Tags()["scalars"] and "hparam/final_loss" in acc.Tags()["scalars"]
    assert any("_hparams_" in tag for tag in acc.summary_metadata)


def _wait_for(path: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_worker_is_recorded_and_resume_reruns_only_it(tmp_path, data_cache):
    grid = write_grid(tmp_path / "g.yaml", "trials:\n  - {optimizer: adamw}\n  - {optimizer: lion}\n")
    out = tmp_path / "out"
    args = [sys.executable, *sweep_args(out, data_cache, "--grid", grid, "--workers", "2")]
    sweep = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = out / "trials" / "g02"
    _wait_for(victim / "metrics.jsonl")  # it is training
    os.kill(int((victim / "pid").read_text()), signal.SIGKILL)
    output, _ = sweep.communicate(timeout=600)
    assert sweep.returncode == 0, output[-3000:]
    rows = {r["trial_id"]: r for r in read_csv(out / "results.csv")}
    assert rows["g02"]["status"] == "crashed" and "SIGKILL" in rows["g02"]["failures"]
    assert "[g02] 8 steps" in rows["g02"]["log_tail"]  # the crashed worker's log tail is kept
    assert "ok in" not in rows["g02"]["log_tail"]
    assert rows["g01"]["status"] == "ok" and len(rows) == 2
    assert "crashed" in (out / "report.md").read_text()
    finished = {t: (out / "trials" / t / "result.json").stat().st_mtime_ns for t in ("g01",)}

    # the rerun uses the other launcher: a fresh `python -m llmlab.sweep.trial` process per trial
    proc = run_script(sweep_args(out, data_cache, "--grid", grid, "--workers", "2", "--launcher", "spawn"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming: 1 finished trial(s) skipped (g01); 1 to run" in proc.stdout
    for trial, mtime in finished.items():
        assert (out / "trials" / trial / "result.json").stat().st_mtime_ns == mtime
    rows = {r["trial_id"]: r for r in read_csv(out / "results.csv")}
    assert {r["status"] for r in rows.values()} == {"ok"}

    changed = run_script(sweep_args(out, data_cache, "--grid", grid, "--steps", "3"))
    assert changed.returncode == 2 and "different settings" in changed.stderr


@pytest.mark.slow
def test_each_fail_safe_trips_and_retries_once(tmp_path, data_cache):
    grid = write_grid(
        tmp_path / "g.yaml",
        "trials:\n"
        "  - {trial_id: blowup, optimizer: adamw, lr: 50.0, clip: 1.0, warmup: 0}\n"
        "  - {trial_id: frozen, lr: 0.0, warmup: 500}\n",
    )
    out = tmp_path / "a"
    proc = run_script(sweep_args(out, data_cache, "--grid", grid, "--workers", "2", "--flat_window", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        r["trial_id"]: json.loads((out / "trials" / r["trial_id"] / "result.json").read_text())
        for r in read_csv(out / "results.csv")
    }
    blowup, frozen = rows["blowup"], rows["frozen"]
    assert blowup["status"] == "failed" and blowup["boundary"] and blowup["attempts"] == 2
    assert blowup["fallback"] == "clip 1.0 -> 0.9" and blowup["effective_hparams"]["clip"] == 0.9
    assert all("loss" in f and "> 11." in f for f in blowup["failures"])  # loss > max(10, initial + 1)
    assert frozen["status"] == "failed" and frozen["boundary"] and frozen["fallback"] == "warmup 500 -> 100"
    assert all("probe loss moved 0.00e+00 < 1e-05 over 4 steps" in f for f in frozen["failures"])
    assert "boundary case" in (out / "report.md").read_text()

    # 192x4, not the smoke budget's 64x2: there Lion at lr 50 never reached a gradient norm of 1000 in 8 steps
    spike_trial = "{trial_id: spike, optimizer: lion, lr: 50.0, clip: 0, warmup: 0, size: 192x4}"
    grid = write_grid(tmp_path / "h.yaml", f"trials:\n  - {spike_trial}\n")
    out = tmp_path / "b"
    proc = run_script(sweep_args(out, data_cache, "--grid", grid, "--fail_loss", "1e9"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    spike = json.loads((out / "trials" / "spike" / "result.json").read_text())
    assert spike["status"] == "failed" and "gradient norm" in spike["failures"][0] and "> 1000" in spike["failures"][0]
    assert spike["attempts"] == 1 and spike["fallback"] is None  # no clip to tighten, warmup already < 100


@pytest.mark.slow
def test_hung_trial_is_killed_at_the_timeout_and_the_sweep_goes_on(tmp_path, data_cache):
    # A hung worker (a stuck collective, a stalled disk) is made real with SIGSTOP the moment the trial
    # process exists: it can neither finish nor reach the pre-check, so only the runner's timeout ends it.
    grid = write_grid(tmp_path / "g.yaml", "trials:\n  - {optimizer: adamw}\n  - {optimizer: lion}\n")
    out = tmp_path / "out"
    # 30 s: the healthy trial must still pass its pre-check on a loaded machine (with 20 s and the 192x4 model the
    # smoke budget had then, a CI run sharing the two cores projected g02 past its timeout; at 64x2 a trial takes
    # about a quarter as long, bench/smoke_shape.py)
    # two workers: the healthy trial runs while the hung one waits out its timeout
    args = [sys.executable, *sweep_args(out, data_cache, "--grid", grid, "--trial_timeout", "30", "--workers", "2")]
    sweep = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid_file = out / "trials" / "g01" / "pid"
    _wait_for(pid_file)
    os.kill(int(pid_file.read_text()), signal.SIGSTOP)
    output, _ = sweep.communicate(timeout=600)
    assert sweep.returncode == 0, output[-3000:]
    rows = {r["trial_id"]: r for r in read_csv(out / "results.csv")}
    assert rows["g01"]["status"] == "timeout" and "killed after the 30 s trial timeout" in rows["g01"]["failures"]
    assert rows["g02"]["status"] == "ok"


@pytest.mark.slow
def test_precheck_stops_a_trial_that_cannot_finish_within_its_timeout(tmp_path, data_cache):
    grid = write_grid(tmp_path / "g.yaml", "trials:\n  - {optimizer: adamw}\n")
    out = tmp_path / "out"
    args = sweep_args(out, data_cache, "--grid", grid, "--steps", "1000000", "--trial_timeout", "120")
    proc = run_script(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result_path = out / "trials" / "g01" / "result.json"
    result = json.loads(result_path.read_text())
    # a timeout, not a finished "failed" outcome: a busy machine says nothing about the hparams
    assert result["status"] == "timeout" and result["attempts"] == 1 and result["fallback"] is None
    assert (
        result["failures"][0].startswith("pre-check: projected")
        and "exceeds the trial timeout 120 s" in result["failures"][0]
    )
    assert len(result["curves"]["loss"]) == 10  # stopped at the end of the 10-step pre-check
    assert "note: 1 trial(s) ended without an outcome" in proc.stdout and "--trial_timeout" in proc.stdout
    # a record from before this rule (status "failed") loads as a timeout, so the resume runs the trial again
    atomic_write_json(result_path, {**result, "status": "failed"})
    again = run_script(args)
    assert again.returncode == 0 and "finished trial(s) skipped" not in again.stdout, again.stdout[-3000:]
    assert json.loads(result_path.read_text())["status"] == "timeout"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_trial_uses_fp16_with_grad_scaler(tmp_path, data_cache):
    grid = write_grid(tmp_path / "g.yaml", "trials:\n  - {optimizer: adamw}\n  - {optimizer: lion}\n")
    out = tmp_path / "out"
    proc = run_script(sweep_args(out, data_cache, "--grid", grid, "--device", "cuda", "--workers", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for trial in ("g01", "g02"):
        result = json.loads((out / "trials" / trial / "result.json").read_text())
        assert result["status"] == "ok" and result["peak_memory_mb"] < 4000  # CUDA allocator peak, not RSS
        assert "skipped_steps" in result
    spec = json.loads((out / "trials" / "g02" / "spec.json").read_text())
    assert spec["device"] == "cuda"


def test_help_lists_every_option():
    proc = run_script(["sweep.py", "--help"])
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--grid",
        "--budget",
        "--workers",
        "--trial_timeout",
        "--lrs",
        "--batch_sizes",
        "--clip",
        "--label_smoothing",
        "--model",
        "--fail_grad_norm",
        "--flat_window",
        "--config",
    ):
        assert flag in proc.stdout


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """lr_bs batches beyond --micro_batch_size accumulate: same loss curve and grad norms as one pass."""
    from dataclasses import replace

    import numpy as np
    import torch

    from llmlab.sweep.trial import train_attempt

    hp, spec, data = tiny_trial(tmp_path, "acc", warmup=0, lr=1e-3, position_encoding="sinusoidal")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster on a shared 2-core box
    try:
        runs = [
            train_attempt(
                replace(spec, micro_batch_size=micro),
                hp,
                data,
                torch.device("cpu"),
                tmp_path / str(micro),
                __import__("time").time(),
            )
            for micro in (4, 1)
        ]
    finally:
        torch.set_num_threads(threads)
    assert runs[1]["summary"]["accumulation_steps"] == 4 and runs[0]["summary"]["accumulation_steps"] == 1
    assert np.allclose(runs[0]["curves"]["loss"], runs[1]["curves"]["loss"], atol=1e-4)
    assert np.allclose(runs[0]["curves"]["grad_norm"], runs[1]["curves"]["grad_norm"], rtol=1e-3)


def _gain_case(with_replicates: bool):
    import numpy as np

    from llmlab.sweep.design import replicate
    from llmlab.sweep.report import derived_metrics

    steps = np.arange(200)
    control_curve = list(8 - 2 * (1 - np.exp(-steps / 60)) + 0.05 * np.sin(steps))
    fast_steady = list(8 - 2.2 * (1 - np.exp(-steps / 30)) + 0.01 * np.sin(steps))
    fast_noisy = list(8 - 2.2 * (1 - np.exp(-steps / 30)) + 0.3 * np.sin(steps))
    base = [
        {"trial_id": "control", **CONTROL},
        {"trial_id": "win", **CONTROL, "optimizer": "lion"},
        {"trial_id": "noisy", **CONTROL, "optimizer": "adafactor"},
        {"trial_id": "small", **CONTROL},
    ]
    design = replicate(base, 3 if with_replicates else 1, False, 42)

    def result(trial_id, curve, final_loss):
        tail = np.array(curve[-100:])
        hparams = {k: v for k, v in next(t for t in design if t["trial_id"] == trial_id).items() if k in CONTROL}
        return {
            "trial_id": trial_id,
            "status": "ok",
            "hparams": hparams,
            "curves": {"loss": curve},
            "final_loss": final_loss,
            "stability_index": float(tail.std() / tail.mean()),
        }

    results = [
        result("control", control_curve, 6.0),
        result("win", fast_steady, 5.8),
        result("noisy", fast_noisy, 5.8),
        result("small", fast_steady, 5.97),
    ]
    if with_replicates:  # seed noise of 0.01 nats: a 0.2 gain is resolved, a 0.03 one is not
        results += [result("control-r1", control_curve, 6.01), result("control-r2", control_curve, 5.99)]
    return derived_metrics(design, results, None)


def test_effective_gain_needs_all_three_criteria_and_a_resolved_difference():
    from llmlab.sweep import stats

    rows, facts = _gain_case(with_replicates=True)
    verdict = {r["trial_id"]: r["effective_gain"] for r in rows}
    assert verdict == {
        "control": False,
        "control-r1": False,
        "control-r2": False,
        "win": True,
        "noisy": False,
        "small": False,
    }
    win = next(r for r in rows if r["trial_id"] == "win")
    assert win["gain_resolved"] and win["delta_ci_high"] < 0 < win["delta_ci_high"] + 0.3
    assert win["steps_to_target"] < 0.9 * facts["reference_steps_to_target"]
    assert facts["noise"]["df"] == 2 and abs(facts["noise"]["sd"] - 0.01) < 1e-9
    assert win["delta_p_holm"] < 0.05 and next(r for r in rows if r["trial_id"] == "small")["delta_p_holm"] > 0.05
    contrasts = {c["level"]: c for c in stats.fit_effects(rows, ["optimizer"], {"optimizer": "adamw"})["contrasts"]}
    assert contrasts["lion"]["effect"] < 0 and contrasts["lion"]["reference"] == "adamw"


def test_without_replicates_no_gain_is_resolved():
    rows, facts = _gain_case(with_replicates=False)
    assert facts["noise"]["sd"] is None
    assert not any(r["effective_gain"] or r["gain_resolved"] for r in rows)


def test_a_sweep_of_compiled_trials_ends_quietly(tmp_path):
    """Each compiled trial's torch.compile worker pool used to leak a semaphore through the fork-server child's
    os._exit: the sweep then ended with "resource_tracker: There appear to be N leaked semaphore objects"."""
    from tests.conftest import run_script

    grid = tmp_path / "grid.yaml"
    grid.write_text("trials:\n  - {trial_id: a, lr: 0.001}\n")  # one trial leaked one semaphore
    args = [
        "sweep.py",
        "--grid",
        str(grid),
        "--budget",
        "smoke",
        "--compile",
        "--workers",
        "1",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    proc = run_script(args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'ok': 1" in proc.stdout
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr[-2000:]
