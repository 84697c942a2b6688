#!/usr/bin/env python
"""An effects fit (stats.fit_effects: OLS contrasts, Holm) with and without statsmodels' forced gc.collect().

statsmodels' Holm branch runs a full garbage collection on every call. In a process that holds torch and
transformers, as a sweep's report does, that collection costs far more than the fit. Side by side, in one process
with those libraries loaded: the fit as llmlab runs it (the forced collection skipped) and with the collection
statsmodels would make. Prints a table with medians and the ratio.

  python bench/effects_fit.py            # ~30 s
  python bench/effects_fit.py --repeats 20
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="fits timed per way, alternating")
    args = parser.parse_args()
    import torch  # noqa: F401  the libraries a sweep report's process holds
    import transformers  # noqa: F401

    from llmlab.core.runinfo import machine_label
    from llmlab.sweep import stats
    from llmlab.sweep.design import CONTROL, FACTORS
    from tests.sweep.test_sweep_lab import ORDER, planted_rows

    rows = planted_rows(noise_sd=0.05, seed=1, replicates=2)
    times: dict[str, list[float]] = {"llmlab (collection skipped)": [], "with statsmodels' gc.collect()": []}
    for _ in range(args.repeats):
        for way, seconds in times.items():
            start = time.perf_counter()
            stats.fit_effects(rows, list(FACTORS), CONTROL, "final_loss", ORDER)
            if way.startswith("with"):
                gc.collect()  # the one collection statsmodels' Holm makes per family, as llmlab calls it once a fit
            seconds.append(time.perf_counter() - start)
    baseline = statistics.median(times["with statsmodels' gc.collect()"])
    print(f"{machine_label()}; {len(gc.get_objects()):,} objects tracked; {args.repeats} fits per way, alternating")
    print("| way | median s per fit | speed-up |\n|---|---|---|")
    for way, seconds in times.items():
        print(f"| {way} | {statistics.median(seconds):.3f} | {baseline / statistics.median(seconds):.1f}x |")


if __name__ == "__main__":
    main()
