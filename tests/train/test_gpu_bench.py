"""bench/gpu_throughput.py as on a GPU, but with a tiny model on this CPU: every trainer reports tokens/s and MFU."""

import json

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
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"nanogpt", "llmlab", "trainer"} and all(r["tokens_per_sec"] > 0 for r in rows.values())
    table = proc.stdout
    assert "| H200 | 989.0 |" in table and "| nanogpt |" in table and "1.00x" in table  # peaks first, ratios after
    assert all(f"| {name} |" in table and "%" in table for name in rows)
