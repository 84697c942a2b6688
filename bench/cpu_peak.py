#!/usr/bin/env python
"""This CPU's dense matmul peak in fp32 and bf16, on one thread and on all of them: the denominator of train/mfu.

python bench/cpu_peak.py               # seconds
python bench/cpu_peak.py --size 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048, help="square matmul size (default 2048)")
    parser.add_argument("--repeats", type=int, default=5, help="timed matmuls, the best is kept")
    args = parser.parse_args()
    import torch

    from llmlab.core.device import available_cores, cpu_has_fast_bf16
    from llmlab.core.runinfo import hardware_info
    from llmlab.models.flops import measure_cpu_peak_flops

    cores = available_cores()
    print(
        f"{hardware_info().get('cpu_model')}, {cores} cores, bf16 units: {cpu_has_fast_bf16()}, torch "
        f"{torch.__version__}, {args.size}x{args.size} matmul, best of {args.repeats}"
    )
    print(f"{'threads':>8} {'fp32 GFLOP/s':>14} {'bf16 GFLOP/s':>14} {'bf16 / fp32':>12}")
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        fp32, bf16 = (measure_cpu_peak_flops(p, args.size, args.repeats) / 1e9 for p in ("fp32", "bf16"))
        print(f"{threads:>8} {fp32:>14.0f} {bf16:>14.0f} {bf16 / fp32:>11.2f}x")


if __name__ == "__main__":
    main()
