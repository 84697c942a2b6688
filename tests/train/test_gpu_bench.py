"""bench/gpu_throughput.py as on a GPU, but with a tiny model on this CPU: every trainer reports tokens/s and MFU."""

import json

import pytest

from tests.conftest import run_script


def test_the_gpu_throughput_bench_runs_on_cpu_with_a_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "bench/gpu_throughput.py",
        "--model",
        "gpt2-tiny",
        "--block_size",
        "32",
        "--batch_size",
        "2",
        "--steps",
        "4",
        "--skip",
        "1",
        "--max_documents",
        "5",
        "--output",
        str(out),
    ]
    proc = run_script(args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"nanogpt", "llmlab", "trainer"} and all(r["tokens_per_sec"] > 0 for r in rows.values())
    table = proc.stdout
    assert "| H200 | 989.0 |" in table and "| nanogpt |" in table and "1.00x" in table  # peaks first, ratios after
    assert all(f"| {name} |" in table and "%" in table for name in rows)


def test_the_compile_row_prices_the_compile(monkeypatch):
    """Compiled: 10 s more wall time for 40 steps that each take 0.05 s less: a 12 s compile, earned back in 240."""
    from types import SimpleNamespace

    from tests.conftest import load_script

    bench = load_script("bench/gpu_throughput.py")
    monkeypatch.setattr(bench, "_cuda", lambda: True)  # the default row is the compiled one, the variant eager
    args = SimpleNamespace(batch_size=1, block_size=100, steps=40)
    compiled, eager = {"tokens_per_sec": 2000.0, "wall_s": 70.0}, {"tokens_per_sec": 1000.0, "wall_s": 60.0}
    table = bench.ablation_table({"compile": eager}, compiled, args)
    assert "| 1,000 | 0.50x | compile costs 12 s; earned back after 240 steps |" in table


def test_a_trainer_that_fails_is_a_row_of_the_table_not_the_end_of_it(tmp_path, monkeypatch, capsys):
    """On a lent GPU (minutes, once) one failed trainer must not cost the other rows: its row says why, the others
    keep their numbers and ratios, and the exit status is still a failure."""
    import subprocess
    from types import SimpleNamespace

    from tests.conftest import load_script

    bench = load_script("bench/gpu_throughput.py")

    def fake_run(command, **_):
        name = command[-1]
        if name == "trainer":
            return SimpleNamespace(returncode=1, stdout="", stderr="Traceback ...\nImportError: no module named x")
        speed = {"nanogpt": 1000.0, "llmlab": 1250.0}[name]
        return SimpleNamespace(returncode=0, stdout=json.dumps({"tokens_per_sec": speed, "loss": 7.0}), stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "flops_per_token_of", lambda args: 1e6)
    monkeypatch.setattr(bench, "_cuda", lambda: False)
    out = tmp_path / "rows.json"
    assert bench.main(["--output", str(out)]) == 1
    table = capsys.readouterr().out
    assert "| trainer | failed: ImportError: no module named x |" in table
    assert "| llmlab | 1,250 | 1.25x |" in table and "| nanogpt | 1,000 | 1.00x |" in table
    assert json.loads(out.read_text())["rows"]["trainer"]["failed"].startswith("ImportError")


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--steps", "10", "--skip", "10"]])
def test_bad_bench_options_are_one_line(bad, capsys):
    from tests.conftest import load_script

    with pytest.raises(SystemExit) as exit_info:
        load_script("bench/gpu_throughput.py").main(bad)
    assert exit_info.value.code == 2 and "--repeats must be >= 1 and --skip in [1, --steps)" in capsys.readouterr().err
