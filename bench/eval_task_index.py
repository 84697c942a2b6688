"""What a downstream evaluation pays before its first item: lm-eval's task index.

`TaskManager()` indexes the ~15k task files bundled with lm-eval on construction. Side by side, alternating, in
fresh processes (nothing cached):

    index per evaluation   the old path: a new bundled index for each evaluation (the trainer every N steps)
    bundled, once          llmlab.infer.downstream.task_manager: built once per process, then a cache hit
    own task only          builtin:pydoc-mc alone: its folder, without the bundled files

    python bench/eval_task_index.py --repeats 3 --evaluations 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, tempfile, time
from pathlib import Path
from llmlab.data.choice_tasks import write_pydoc_choice_task
from llmlab.data.pydoc_qa import build_pydoc_records
from llmlab.infer.downstream import task_manager
mode, evaluations = sys.argv[1], int(sys.argv[2])
name, folder = write_pydoc_choice_task(Path(tempfile.mkdtemp()) / "pydoc-mc", build_pydoc_records(["json"]))
from lm_eval.tasks import TaskManager  # imported before the clock starts: every mode pays the import alike
start = time.perf_counter()
for _ in range(evaluations):
    if mode == "index per evaluation":
        manager = TaskManager(include_path=[str(folder)])
    else:
        manager = task_manager((str(folder),), with_bundled=mode == "bundled, once")
    assert name in manager.all_tasks
print(json.dumps(time.perf_counter() - start))
"""

MODES = ("index per evaluation", "bundled, once", "own task only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per mode, run alternately")
    parser.add_argument("--evaluations", type=int, default=3, help="evaluations in one run (an eval every N steps)")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.repeats):
            for mode in MODES:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, mode, str(args.evaluations)],
                    cwd=cwd,
                    env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_DATASETS_OFFLINE": "1"},
                    capture_output=True,
                    text=True,
                    check=True,
                )
                seconds[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(seconds[MODES[0]])
    print(f"task index for {args.evaluations} evaluation(s) in one process, median of {args.repeats} (s)")
    print(f"| {'path':22s} | median s | range | vs index per evaluation |")
    print("|---|---|---|---|")
    for mode in MODES:
        values = seconds[mode]
        median = statistics.median(values)
        print(f"| {mode:22s} | {median:8.3f} | {min(values):.3f}-{max(values):.3f} | {base / median:.1f}x |")


if __name__ == "__main__":
    main()
