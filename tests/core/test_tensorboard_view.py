"""The README's `tensorboard --logdir runs` over a pretraining run, a LoRA run and a sweep: the HParams tab lists every
kind's hyperparameters with metrics, read back through TensorBoard's own HTTP API, as a user's browser would."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import REPO, free_port, run_in_process, run_script, tiny_pretrain_args
from tests.train.test_lora import TINY_RUN

SMALL = tiny_pretrain_args(sample_tokens=0)


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_hparams_tab_shows_every_kind_of_run_with_metrics(tmp_path, tiny_gpt2_dir, pydoc_cache_dir, pretrain_cache):
    runs = tmp_path / "runs"
    assert (
        run_in_process(
            [
                "train_pretrain.py",
                *SMALL,
                "--max_steps",
                "3",
                "--eval_every",
                "3",
                "--cache_dir",
                str(pretrain_cache),
                "--output_dir",
                str(runs / "pretrain"),
            ]
        ).returncode
        == 0
    )
    assert (
        run_in_process(
            [
                "train_lora.py",
                "--base_model",
                str(tiny_gpt2_dir),
                "--cache_dir",
                str(pydoc_cache_dir),
                "--output_dir",
                str(runs / "lora"),
                *TINY_RUN,
                "--max_steps",
                "2",
            ]
        ).returncode
        == 0
    )
    grid = tmp_path / "grid.yaml"
    grid.write_text("trials:\n  - {trial_id: a}\n  - {trial_id: b, optimizer: lion}\n")
    assert (
        run_script(
            [
                "sweep.py",
                "--grid",
                str(grid),
                "--budget",
                "smoke",
                "--steps",
                "4",
                "--precheck_steps",
                "2",
                "--output_dir",
                str(runs / "sweep"),
            ],
            timeout=600,
        ).returncode
        == 0
    )
    assert not [p for p in runs.rglob("hparams.yml")]  # no separate metric-less hparams runs
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(runs), "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}/data/plugin/hparams"
        deadline, experiment = time.time() + 120, {}
        while time.time() < deadline:
            try:
                experiment = post(f"{base}/experiment", {"experimentName": ""})
                if len(experiment.get("hparamInfos", [])) > 20:
                    break
            except OSError:
                pass
            time.sleep(1)
        hparams = {h["name"] for h in experiment.get("hparamInfos", [])}
        metrics = {m["name"]["tag"] for m in experiment.get("metricInfos", [])}
        assert {"model", "lora_r", "optimizer", "scheduler"} <= hparams, sorted(hparams)  # all three kinds
        assert {"val/loss", "hparam/final_loss"} <= metrics, sorted(metrics)
        groups = post(
            f"{base}/session_groups",
            {
                "experimentName": "",
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                "colParams": [],
                "startIndex": 0,
                "sliceSize": 100,
            },
        )
        assert groups["totalSize"] >= 4  # pretraining, LoRA and both trials, each its own session
        with_values = [g for g in groups["sessionGroups"] if g.get("metricValues")]
        assert len(with_values) >= 4
    finally:
        server.terminate()
        server.wait(timeout=30)
