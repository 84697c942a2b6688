#!/usr/bin/env bash
# The one prepared call for a lent GPU (device tool), within its 600 s: GPT-2 124M throughput of the three trainers
# first, then the smoke's first checks (bf16 and fp16 pretraining), then llmlab with each piece of its fast path
# changed, for what time is left (each row is printed as it ends). Tables land in $OUT (the device tool brings that
# folder back); commit them under docs/findings/gpu-smoke/.
#   Here, first:  bash scripts/gpu_wheels.sh          (builds .whl/: that machine has no package registry)
#   Then the device tool's run, with carry [".whl"] and timeout_s 600:  OUT=$OUT bash scripts/gpu_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmlab_gpu_call}
mkdir -p "$OUT"
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the pins the machine's image lacks, installed offline over it (PYTHONPATH comes first)
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/install.log" 2>&1 || { tail -n 20 "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ here: run scripts/gpu_wheels.sh and carry .whl, or install requirements.txt first" >&2
fi
$PYTHON - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md
import torch
names = ["torch", "transformers", "accelerate", "deepspeed", "bitsandbytes", "peft", "datasets", "huggingface_hub"]
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device", "| CUDA", torch.version.cuda)
for name in names:
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
timeout 270 $PYTHON bench/gpu_throughput.py --output "$OUT/gpu_throughput.json" 2>&1 | tee "$OUT/gpu_throughput.txt"
timeout 130 bash scripts/gpu_smoke.sh "$OUT/smoke" 2>&1 | tail -n 40 | tee "$OUT/gpu_smoke.txt"
cp "$OUT/smoke/results.txt" "$OUT/gpu_smoke_results.txt" 2>/dev/null || true
timeout 170 $PYTHON bench/gpu_throughput.py --trainers llmlab --ablate all --steps 30 \
  --output "$OUT/gpu_ablation.json" 2>&1 | tee "$OUT/gpu_ablation.txt"
