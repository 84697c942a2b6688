"""sweep.py --launcher ray on a real 2-node Ray cluster on this host (loopback only), shared by the file's tests: a
node removed mid-sweep, trials on both nodes, the same losses as the local launcher, a killed driver's resume, the
timeout on the node, and the one-line error without a cluster."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_script, sweep_args
from tests.sweep.conftest import read_csv

# Ray binds the machine's external address unless told otherwise (../shared/platform-facts.md): loopback only.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def two_node_cluster():
    pytest.importorskip("ray")
    saved = {name: os.environ.get(name) for name in LOOPBACK}
    os.environ.update(LOOPBACK)
    from ray.cluster_utils import Cluster

    sigterm = signal.getsignal(signal.SIGTERM)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster, second
    cluster.shutdown()
    # the head node's SIGTERM handler outlives it, and every process this test process forks later inherits it
    signal.signal(signal.SIGTERM, sigterm)
    for name, value in saved.items():
        os.environ.pop(name) if value is None else os.environ.update({name: value})


def results_by_node(out) -> dict:
    by_node: dict[str, list[str]] = {}
    for path in (out / "trials").glob("*/result.json"):
        try:
            result = json.loads(path.read_text())
        except ValueError:
            continue
        by_node.setdefault(result.get("node"), []).append(result["trial_id"])
    return by_node


# four doe20 design choices, each a trial of its own: one finished on each node, then one running on each when a
# node is lost (its trial runs again on the other or on the replacement)
GRID = """trials:
  - {optimizer: adamw}
  - {optimizer: lion}
  - {optimizer: adafactor}
  - {scheduler: linear}
"""


@pytest.mark.slow
def test_a_smoke_grid_on_two_nodes_survives_a_lost_node_and_matches_the_local_launcher(
    two_node_cluster, data_cache, tmp_path
):
    cluster, second = two_node_cluster
    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    # the local launcher on the grid's first trial (the same id, settings and seed): the reference numbers
    (tmp_path / "local.yaml").write_text("\n".join(GRID.splitlines()[:2]) + "\n")
    local = run_script(sweep_args(tmp_path / "local", data_cache, "--grid", str(tmp_path / "local.yaml")), timeout=900)
    assert local.returncode == 0, local.stderr[-3000:]
    out = tmp_path / "ray"
    args = sweep_args(
        out,
        data_cache,
        "--grid",
        str(grid),
        "--launcher",
        "ray",
        "--ray_address",
        cluster.address,
        "--cpus_per_trial",
        "1",
        "--node_retries",
        "2",
    )
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, **LOOPBACK},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600
    while len(results_by_node(out)) < 2:  # both nodes have finished a trial: the second is now mid-trial
        if proc.poll() is not None or time.time() > deadline:  # killed first: its output is then bounded too
            proc.kill()
            pytest.fail(f"no trial finished on a second node: {proc.communicate(timeout=60)[1][-3000:]}")
        time.sleep(0.2)
    cluster.remove_node(second)  # a machine lost mid-sweep: its trial runs again elsewhere
    cluster.add_node(num_cpus=1)  # and a replacement joins, as a user would restart it
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Ray cluster: 2 node(s), 2 CPUs" in stdout
    rows = read_csv(out / "results.csv")
    assert sorted(r["trial_id"] for r in rows) == sorted({r["trial_id"] for r in rows}) and len(rows) == 4
    assert {r["status"] for r in rows} == {"ok"}
    assert len({r["node"] for r in rows}) >= 2  # trials ran on several nodes
    local = {r["trial_id"]: r for r in read_csv(tmp_path / "local" / "results.csv")}
    assert sorted(local) == ["g01"]
    for row in (r for r in rows if r["trial_id"] in local):  # the same subprocess, data and seeds: the same numbers
        assert float(row["final_loss"]) == pytest.approx(float(local[row["trial_id"]]["final_loss"]), abs=1e-5)
    assert (out / "trials" / "g04" / "tensorboard").is_dir() and (out / "trials" / "g04" / "log.txt").is_file()


def test_no_cluster_is_a_one_line_error_naming_the_address(tmp_path, data_cache):
    pytest.importorskip("ray")
    proc = run_script(
        sweep_args(tmp_path / "x", data_cache, "--grid", "doe20", "--launcher", "ray", "--ray_address", "127.0.0.1:1"),
        timeout=300,
    )
    assert proc.returncode == 2 and "127.0.0.1:1" in proc.stderr and "ray start --head" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "x").exists()  # refused before anything was written


SMALL_GRID = [
    "--grid",
    "lr_bs",
    "--model",
    "minimal",
    "--lrs",
    "1e-3",
    "3e-3",
    "--batch_sizes",
    "2",
]  # 2 smoke trials, one on each node


@pytest.mark.slow
def test_a_killed_driver_resumes_without_rerunning_and_the_timeout_holds_on_the_node(
    two_node_cluster, data_cache, tmp_path
):
    cluster, _ = two_node_cluster
    out = tmp_path / "killed"
    args = [
        sys.executable,
        *sweep_args(out, data_cache, *SMALL_GRID, "--launcher", "ray", "--ray_address", cluster.address),
    ]
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env={**os.environ, **LOOPBACK},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not list((out / "trials").glob("*/result.json")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, 9)
    proc.wait()
    finished = {p.parent.name: p.stat().st_mtime_ns for p in (out / "trials").glob("*/result.json")}
    resumed = run_script(args[1:], timeout=600, env=LOOPBACK)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming: {len(finished)} finished trial(s) skipped" in resumed.stdout
    assert {
        p.parent.name: p.stat().st_mtime_ns for p in (out / "trials").glob("*/result.json") if p.parent.name in finished
    } == finished  # nothing ran twice
    rows = read_csv(out / "results.csv")
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}

    # --trial_timeout is enforced where the trial runs: 1 s does not even cover its imports (two trials show it)
    slow = run_script(
        sweep_args(
            tmp_path / "timeout",
            data_cache,
            *SMALL_GRID,
            "--launcher",
            "ray",
            "--ray_address",
            cluster.address,
            "--trial_timeout",
            "1",
            "--no-rerun_crashed",
        ),
        timeout=600,
        env=LOOPBACK,
    )
    assert slow.returncode == 0, slow.stderr[-3000:]
    rows = read_csv(tmp_path / "timeout" / "results.csv")
    assert {r["status"] for r in rows} == {"timeout"} and all("1 s trial timeout" in r["failures"] for r in rows)
    assert all(r["node"] for r in rows)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--cpus_per_trial", "0"], "--cpus_per_trial must be > 0"),
        (["--gpus_per_trial", "-1"], "--gpus_per_trial and --node_retries >= 0"),
        (["--node_retries", "-1"], "--gpus_per_trial and --node_retries >= 0"),
        (["--gpus_per_trial", "1"], "pass --precision bf16, fp16 or fp32"),
    ],
)
def test_bad_ray_options_are_one_line_errors_before_anything_is_written(tmp_path, flags, needle):
    proc = run_script(sweep_args(tmp_path / "x", tmp_path / "cache", "--grid", "doe20", "--launcher", "ray", *flags))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "x").exists()
