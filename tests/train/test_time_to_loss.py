"""bench/time_to_loss.py (issue 52): the quick start judged by the loss it reaches in its time. Its arithmetic on
planted curves, its contrast against an independent recomputation, and llmlab's curve read from a real tiny run."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/time_to_loss.py")


def test_time_to_target_and_loss_at_interpolate_between_evaluations(bench):
    curve = [(10.0, 8.0), (20.0, 7.0), (30.0, 6.5)]
    assert bench.time_to(curve, 7.5) == pytest.approx(15.0)
    assert bench.time_to(curve, 8.5) == 10.0  # reached at the first evaluation: no earlier point to interpolate from
    assert bench.time_to(curve, 6.0) is None
    assert bench.loss_at(curve, 25.0) == pytest.approx(6.75)
    assert bench.loss_at(curve, 99.0) == 6.5 and bench.loss_at(curve, 1.0) == 8.0


def test_the_contrast_against_the_reference_is_paired_by_seed_and_matches_scipy(bench):
    """Planted: the variant is 0.1-0.2 nats lower at every seed and twice as fast to the target; the seeds differ far
    more than that from each other, so only a paired contrast sees it."""
    reference = [[(10.0, 8.0 + s), (20.0, 7.0 + s), (40.0, 6.0 + s)] for s in (0.0, 0.5, 1.0)]
    variant = [
        [(5.0, 8.0 + s - d), (10.0, 7.0 + s - d), (20.0, 6.0 + s - d)] for s, d in ((0, 0.1), (0.5, 0.2), (1, 0.15))
    ]
    result = bench.summary({"llmlab": reference, "variant": variant}, target=7.5, at_seconds=20.0)
    assert result["reference"] == "llmlab" and result["at_seconds"] == 20.0
    row = result["table"]["variant"]
    ours = [bench.loss_at(c, 20.0) for c in variant]
    theirs = [bench.loss_at(c, 20.0) for c in reference]
    independent = stats.ttest_rel(ours, theirs).confidence_interval(0.95)
    contrast = row["loss_at_minus_reference"]
    assert contrast["df"] == 2 and contrast["ci95"] == pytest.approx([independent.low, independent.high])
    assert contrast["mean"] == pytest.approx(sum(a - b for a, b in zip(ours, theirs)) / 3)
    assert contrast["ci95"][1] < 0  # resolved: lower at equal time
    # the variant's target time: 7.5 + s - d reached between 5 s and 10 s; the reference's at 15 s for seed 0
    assert (
        row["time_ratio"]["median"] < 0.75
        and row["time_ratio"]["pairs"] == 3
        and result["table"]["llmlab"]["reached"] == "3 of 3"
    )
    assert row["train_seconds_ratio"] == pytest.approx(0.5)  # its 3 evaluations' clock: 20 s against 40 s
    text = bench.format_table(result)
    assert "reference" in text and f"{contrast['mean']:+.3f}" in text and ", 2" in text


def test_one_seed_gives_no_interval(bench):
    curve = [[(10.0, 8.0), (20.0, 7.0)]]
    row = bench.summary({"a": curve, "b": curve}, target=6.0, at_seconds=None)["table"]["b"]
    assert row["loss_at_minus_reference"]["ci95"] is None and row["time_ratio"] is None
    assert row["seconds_to_target"] is None and row["reached"] == "0 of 1"


def test_llmlab_curve_is_read_from_a_real_run(bench):
    """A real tiny `train_pretrain.py`: one (training seconds, validation loss) point per evaluation, the training
    clock rising, the losses finite and under the uniform guess."""
    flags = ["--max_steps", "6", "--max_documents", "5", "--block_size", "32", "--batch_size", "2"]
    curve = bench.llmlab_curve(flags, seed=0, eval_every=3)
    assert len(curve) == 2 and 0 < curve[0][0] < curve[1][0]
    assert all(math.isfinite(loss) and loss < math.log(50257) for _, loss in curve)
