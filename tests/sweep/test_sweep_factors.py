"""The factor registry and the typed trial contract (issue 21): level checks, defaults, replicate names, warmup at
every budget, and the factors the original lab had (accumulation, loss masking, token-masking ratio) in real runs."""

import json
import math

import numpy as np
import pytest

from llmlab.core.config import parse_config
from llmlab.core.errors import UserError
from llmlab.sweep.config import SweepConfig
from llmlab.sweep.design import build_design, grid_from_yaml
from llmlab.sweep.factors import EXTRA_FACTORS, FACTORS, REGISTRY, resolve
from llmlab.sweep.spec import Hparams, TrialSpec
from tests.conftest import run_script


def test_every_factor_has_a_check_a_default_and_a_trial_field(tmp_path):
    cfg = parse_config(SweepConfig, [])
    levels = resolve(cfg, {})
    assert set(levels) == set(REGISTRY) == set(Hparams.__dataclass_fields__)
    assert set(FACTORS) | set(EXTRA_FACTORS) == set(REGISTRY)
    assert levels["lr"] == 1e-3 and levels["accumulation"] == 1 and levels["loss_mask"] == "full"
    spec = TrialSpec(
        trial_id="t", trial_dir=str(tmp_path), data_dir=str(tmp_path), hparams=Hparams(**levels), seed=1, steps=10
    )
    assert TrialSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec  # written as JSON, read back typed
    with pytest.raises(ValueError, match="unknown spec keys"):
        TrialSpec.from_json({**spec.to_json(), "print_parameters": True})


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ("{lr: .nan}", "lr = nan is invalid"),
        ("{weight_decay: .inf}", "weight_decay = inf is invalid"),
        ("{clip: .nan}", "clip = nan is invalid"),
        ("{accumulation: 0}", "accumulation = 0 is invalid"),
        ("{loss_mask: both}", "one of full, padding"),
        ("{token_mask_ratio: 1.0}", "token_mask_ratio = 1.0"),
        ("{lr: -1}", "lr = -1 is invalid"),
        ("{batch_size: true}", "batch_size = True is invalid"),
    ],
)
def test_bad_levels_are_one_line_errors_naming_the_trial(tmp_path, entry, fragment):
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"trials:\n  - {entry}\n")
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")) as info:
        grid_from_yaml(grid)
    assert "trial 1" in str(info.value) and "\n" not in str(info.value)


def test_a_replicate_name_taken_by_a_grid_trial_is_refused(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("replicates: 2\ntrials:\n  - {trial_id: control}\n  - {trial_id: control-r1, optimizer: lion}\n")
    with pytest.raises(UserError, match="'control-r1' names two runs"):
        build_design(parse_config(SweepConfig, ["--grid", str(grid)]))


def test_warmup_is_scaled_at_every_budget_and_an_unfinished_warmup_is_refused(tmp_path):
    from llmlab.sweep.runner import trial_specs

    info = {"block_size": 512, "train_rows": 4700}  # the full budget on ~2.4M tokens: 3 epochs at batch 8
    full = parse_config(SweepConfig, ["--budget", "full", "--grid", "doe20"])
    specs = trial_specs(full, build_design(full), info, tmp_path)
    steps = specs[0].steps
    assert steps == 3 * 4700 // 8
    for spec in specs:
        assert round(spec.hparams.warmup * spec.warmup_scale) < spec.steps  # warmup 1000 ends before the last step
    keep = parse_config(SweepConfig, ["--budget", "full", "--grid", "doe20", "--no-scale_warmup"])
    with pytest.raises(UserError, match="never reach its peak"):
        trial_specs(keep, build_design(keep), {"block_size": 512, "train_rows": 800}, tmp_path)


GRID = """\
trials:
  - {trial_id: control, batch_size: 8}
  - {trial_id: acc2, batch_size: 8, accumulation: 2}
  - {trial_id: acc4, batch_size: 8, accumulation: 4}
  - {trial_id: acc8, batch_size: 8, accumulation: 8}
  - {trial_id: padded, batch_size: 8, loss_mask: padding}
  - {trial_id: halfmask, batch_size: 8, token_mask_ratio: 0.5}
"""


@pytest.mark.slow
def test_new_factors_run_in_a_yaml_grid(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    out = tmp_path / "out"
    proc = run_script(
        [
            "sweep.py",
            "--grid",
            str(grid),
            "--budget",
            "smoke",
            "--workers",
            "2",
            "--threads_per_worker",
            "1",
            "--output_dir",
            str(out),
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {p.parent.name: json.loads(p.read_text()) for p in (out / "trials").glob("*/result.json")}
    assert {r["status"] for r in results.values()} == {"ok"}
    control = results["control"]
    for name, accumulation in (("acc2", 2), ("acc4", 4), ("acc8", 8)):  # equal effective batch, same gradients
        assert (
            results[name]["accumulation_steps"] == accumulation
            and results[name]["micro_batch_size"] == 8 // accumulation
        )
        assert results[name]["final_loss"] == pytest.approx(control["final_loss"], abs=2e-3)
    assert results["padded"]["final_loss"] != control["final_loss"]
    assert results["halfmask"]["curves"]["loss"][0] != control["curves"]["loss"][0]  # half the targets: another mean
    entropy = control["curves"]["attention_entropy"]
    assert len(entropy) >= 4 and all(0 < value < math.log(32) + 1e-6 for _, value in entropy)
    assert control["grad_param_ratio_mean"] > 0 and control["update_ratio_mean"] > 0
    header = (out / "results.csv").read_text().splitlines()[0]
    assert "grad_param_ratio_mean" in header and "accumulation" in header and "token_mask_ratio" in header


def test_document_rows_pad_and_mask_and_the_token_mask_alternates():
    from llmlab.train.batches import EOS, document_rows, target_mask

    tokens = np.array([5, 6, 7, EOS, 8, 9, 10, 11, 12, EOS])
    rows, real = document_rows(tokens, 4)
    assert rows.tolist() == [[5, 6, 7, EOS], [8, 9, 10, 11], [12, EOS, EOS, EOS]]
    assert real.tolist() == [[True] * 4, [True] * 4, [True, True, False, False]]
    mask = target_mask(2, 6, 0.5)
    assert mask[0].tolist() == [False, True, False, True, False, True]  # every other target, shifted per row
    assert mask[1].tolist() == [True, False, True, False, True, False]
    assert target_mask(3, 8, 0.25).mean() == pytest.approx(0.75)
