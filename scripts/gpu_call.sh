#!/usr/bin/env bash
# The one prepared call for a lent GPU (device tool): GPT-2 124M throughput first (about 5 minutes), then the smoke
# with what time is left. Tables land in $OUT (the device tool brings that folder back); commit them under
# docs/findings/gpu-smoke/.   Usage: OUT=/some/dir bash scripts/gpu_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmlab_gpu_call}
mkdir -p "$OUT"
pip install -q -r requirements.txt >"$OUT/install.log" 2>&1 || { tail -n 20 "$OUT/install.log"; exit 1; }
timeout 360 python bench/gpu_throughput.py --output "$OUT/gpu_throughput.json" 2>&1 | tee "$OUT/gpu_throughput.txt"
timeout 480 bash scripts/gpu_smoke.sh "$OUT/smoke" 2>&1 | tail -n 40 | tee "$OUT/gpu_smoke.txt"
cp "$OUT/smoke/results.txt" "$OUT/gpu_smoke_results.txt" 2>/dev/null || true
