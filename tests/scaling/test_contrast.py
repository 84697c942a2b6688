"""sweep.py contrast: each arm (optimizer:schedule) at its own best lr, at equal wall time, judged on fresh seeds
paired by seed, with Holm over the arms."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from llmlab.core.errors import UserError
from llmlab.scaling.contrast import contrast_main, equal_time_steps, paired_contrasts, parse_arm
from tests.conftest import run_script
from tests.scaling.test_scaling import git

ARMS = ["adamw:cosine", "muon:cosine", "adamw:wsd"]


def test_plan_gives_every_arm_the_reference_wall_time_and_its_own_lr_scan(tmp_path):
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"medians": {"adamw": {"step": 0.40}, "muon": {"step": 0.50}}}))
    assert equal_time_steps(300, [parse_arm(a) for a in ARMS], json.loads(times.read_text())) == {
        "adamw:cosine": 300,
        "muon:cosine": 240,  # 300 x 0.40 / 0.50: Muon's dearer step buys fewer of them
        "adamw:wsd": 300,
    }
    contrast_main(["plan", "--step_times", str(times), "--lrs", "1e-3", "2e-3", "--output", str(tmp_path / "g.yaml")])
    grid = yaml.safe_load((tmp_path / "g.yaml").read_text())
    assert grid["replicates"] == 3 and grid["replicate_all"] is True
    assert [(t["optimizer"], t["scheduler"], t["lr"], t["size"]) for t in grid["trials"]][:3] == [
        ("adamw", "cosine", 1e-3, "128x12@300"),
        ("adamw", "cosine", 2e-3, "128x12@300"),
        ("muon", "cosine", 1e-3, "128x12@240"),
    ]
    for argv, needle in (
        (["plan", "--arms", "adamw:cosine", "sgd:cosine"], "OPTIMIZER:SCHEDULE"),
        (["plan", "--arms", "adamw:cosine"], "at least one arm"),
        (["confirm"], "--from_dir"),
        (["mystery"], "takes a stage first"),
        (["plan", "--steps", "0"], "--steps and --batch_size must be >= 1"),
        (["plan", "--replicates", "1"], "a seed SD needs two"),
        (["plan", "--lrs", "0"], "--lrs must be learning rates > 0"),
    ):
        with pytest.raises(UserError, match=needle):
            contrast_main(argv)


def test_paired_contrasts_recover_a_planted_difference_with_holm_over_the_arms():
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(8):
        block = rng.normal(0, 0.05)  # a seed moves every arm alike: pairing removes it
        for arm, shift in (("adamw:cosine", 0.0), ("muon:cosine", -0.10), ("adamw:wsd", 0.0)):
            optimizer, scheduler = arm.split(":")
            loss = 6.0 + shift + block + rng.normal(0, 0.01)
            rows.append(
                {"optimizer": optimizer, "scheduler": scheduler, "seed": seed, "status": "ok", "final_loss": loss}
            )
    rows.append({**rows[0], "seed": 99, "final_loss": math.nan})  # unpaired and not finite: left out
    muon, wsd = paired_contrasts(rows, ARMS)
    assert muon["pairs"] == 8 and muon["df"] == 7 and muon["ci"][0] < -0.10 < muon["ci"][1] and muon["resolved"]
    assert wsd["ci"][0] < 0 < wsd["ci"][1] and not wsd["resolved"]
    assert muon["p_holm"] == pytest.approx(min(1.0, 2 * muon["p"]))  # the smaller p of two, x 2
    assert wsd["p_holm"] >= muon["p_holm"]


@pytest.mark.slow
def test_confirm_runs_each_arm_at_its_own_lr_and_steps_and_the_report_pairs_seeds(tmp_path, data_cache, capsys):
    """A planted stage-1 scan (two arms, their optima apart) gives each arm its own lr; the confirmation grid then
    runs for real (minimal probe, smoke budget), each arm its own steps, and the report pairs its seeds."""
    from tests.conftest import sweep_args

    scan = tmp_path / "scan"
    design = []
    for arm, centre, steps in (("adamw:cosine", 2e-3, 8), ("muon:cosine", 8e-3, 6)):
        optimizer, scheduler = arm.split(":")
        for lr in [float(f"{centre * 1.1 * 2 ** (k / 2):.3g}") for k in range(-3, 4)]:
            for seed in range(3):
                trial_id = f"{optimizer}-{lr:.3g}-r{seed}"
                hparams = {"optimizer": optimizer, "scheduler": scheduler, "lr": lr, "size": f"32x1@{steps}"}
                result = {"trial_id": trial_id, "status": "ok", "seed": seed, "n_params": 8000}
                result |= {"hparams": {**hparams, "batch_size": 2, "clip": 2.0}}
                result["final_loss"] = 6 + 0.2 * math.log(lr / centre) ** 2 + 0.005 * ((seed * 7 + len(design)) % 3)
                (scan / "trials" / trial_id).mkdir(parents=True)
                (scan / "trials" / trial_id / "result.json").write_text(json.dumps(result))
                design.append({"trial_id": trial_id})
    (scan / "design.json").write_text(json.dumps(design))
    arms = ["--arms", "adamw:cosine", "muon:cosine"]
    confirm = ["confirm", *arms, "--from_dir", str(scan), "--replicates", "2", "--seed", "5"]
    git(tmp_path, "init", "-q")
    with pytest.raises(UserError, match="blind by commit"):  # the chosen lrs are registered before any grid exists
        contrast_main(confirm)
    assert (scan / "contrast_lrs.json").is_file() and not (scan / "confirm.yaml").exists()
    git(tmp_path, "add", "scan/contrast_lrs.json")
    git(tmp_path, "commit", "-q", "-m", "register the arms' lrs")
    contrast_main(confirm)
    chosen = json.loads((scan / "contrast_lrs.json").read_text())
    assert chosen["adamw:cosine"]["lr"] == pytest.approx(2e-3, rel=0.1)
    assert chosen["muon:cosine"]["lr"] == pytest.approx(8e-3, rel=0.1)
    grid = yaml.safe_load((scan / "confirm.yaml").read_text())
    assert [t["size"] for t in grid["trials"]] == ["32x1@8", "32x1@6"] and grid["replicates"] == 2
    out = tmp_path / "confirm"
    args = sweep_args(out, data_cache, "--model", "minimal", "--workers", "2", grid=scan / "confirm.yaml")
    proc = run_script(args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in out.glob("trials/*/result.json")]
    assert sorted((r["hparams"]["optimizer"], r["steps"], r["seed"]) for r in results) == [
        ("adamw", 8, 5),
        ("adamw", 8, 6),
        ("muon", 6, 5),
        ("muon", 6, 6),
    ]
    contrast_main(["report", *arms, "--from_dir", str(out)])
    (contrast,) = json.loads((out / "contrasts.json").read_text())["contrasts"]
    assert contrast["arm"] == "muon:cosine" and contrast["pairs"] == 2 and contrast["df"] == 1
    assert "| muon:cosine |" in capsys.readouterr().out
    assert f"at commit {git(tmp_path, 'rev-parse', 'HEAD')}" in json.loads((out / "contrasts.json").read_text())["grid"]
