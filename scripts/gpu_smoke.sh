#!/usr/bin/env bash
# GPU smoke test: runs every CUDA path of the four scripts briefly and prints a pass/fail table.
#   bf16 + fp16 (dynamic loss scale) pretraining, DeepSpeed ZeRO-2 + CPU offload with resume, LoRA under bf16,
#   merge to fp16, fp16 / bitsandbytes int8 / int4 generation and bench, sweep trials with fp16 + GradScaler,
#   and the CUDA-only pytest cases (-m gpu).
# Usage: bash scripts/gpu_smoke.sh [WORK_DIR]   (about 10 minutes on one recent GPU; needs requirements.txt installed)
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/llmlab_gpu_smoke}
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false LLMLAB_CACHE="$WORK/cache"
PY=${PYTHON:-python}
# accelerate through the interpreter, so it is the one PYTHONPATH puts first (a lent machine's carried wheels)
LAUNCH="$PY -m accelerate.commands.launch"
RESULTS=()

check() {  # check NAME TIMEOUT_S COMMAND... : run, time, record pass/fail with the last output line
  local name=$1 limit=$2; shift 2
  local log="$WORK/$name.log" start=$SECONDS
  echo "=== $name: $*" | tee "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$? took=$((SECONDS - start))
  local last; last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-90)
  if [ $rc -eq 0 ]; then RESULTS+=("$(printf '%-26s %-5s %5ss  %s' "$name" ok "$took" "$last")")
  else RESULTS+=("$(printf '%-26s %-5s %5ss  rc=%s %s' "$name" FAIL "$took" "$rc" "$last")"); tail -n 30 "$log"; fi
  # each row is written the moment it exists, so a smoke cut short by an outer time limit still leaves its table
  echo "${RESULTS[-1]}" | tee -a "$WORK/results.txt"
}

check cuda_info 120 $PY -c "
import torch, bitsandbytes, deepspeed
assert torch.cuda.is_available(), 'no CUDA device'
print(torch.cuda.get_device_name(0), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'bf16', torch.cuda.is_bf16_supported(), 'bnb', bitsandbytes.__version__, 'deepspeed', deepspeed.__version__)"

TINY=(--max_documents 40 --eval_every 20 --save_every 20 --log_every 5)
check pretrain_bf16 300 $LAUNCH --config_file accelerate_configs/one_gpu.yaml train_pretrain.py \
  "${TINY[@]}" --max_steps 40 --mixed_precision bf16 --output_dir "$WORK/pre_bf16"
check pretrain_fp16_scale 300 bash -c "$LAUNCH --config_file accelerate_configs/one_gpu.yaml \
  train_pretrain.py ${TINY[*]} --max_steps 20 --mixed_precision fp16 --output_dir $WORK/pre_fp16 &&
  grep -q 'train/loss_scale' $WORK/pre_fp16/metrics.jsonl && echo 'fp16 loss scale logged'"
check zero2_offload_bf16 420 $LAUNCH --config_file accelerate_configs/one_gpu_zero2_offload.yaml \
  train_pretrain.py "${TINY[@]}" --max_steps 20 --mixed_precision bf16 --output_dir "$WORK/pre_ds"
check zero2_offload_resume 420 $LAUNCH --config_file accelerate_configs/one_gpu_zero2_offload.yaml \
  train_pretrain.py "${TINY[@]}" --max_steps 30 --mixed_precision bf16 --output_dir "$WORK/pre_ds" \
  --resume_from_checkpoint latest
check lora_bf16 300 $LAUNCH --num_processes 1 --mixed_precision bf16 train_lora.py \
  --base_model "$WORK/pre_bf16/final" --output_dir "$WORK/lora" --max_steps 20 --max_examples 400 \
  --eval_examples 16 --eval_every 10
check merge_fp16 180 $PY merge_and_infer.py merge --base_model "$WORK/pre_bf16/final" \
  --adapter "$WORK/lora/adapter" --out "$WORK/merged" --dtype fp16
for precision in fp16 bf16 int8 int4; do
  check "generate_$precision" 180 $PY merge_and_infer.py generate --model "$WORK/merged" --precision $precision \
    --prompt "What does json.dumps do?" --max_new_tokens 24 --seed 0
done
check infer_bench 300 $PY merge_and_infer.py bench --model "$WORK/merged" --output "$WORK/bench.json"
printf 'trials:\n  - {optimizer: adamw}\n  - {optimizer: lion}\n  - {optimizer: adafactor}\n' > "$WORK/grid.yaml"
check sweep_fp16_scaler 420 $PY sweep.py --grid "$WORK/grid.yaml" --budget smoke --device cuda --precision fp16 --workers 2 \
  --output_dir "$WORK/sweep"
check pytest_gpu 600 $PY -m pytest -q -m gpu tests

echo
echo "llmlab GPU smoke ($(date -u +%F\ %T) UTC) -- logs in $WORK"
printf '%-26s %-5s %6s  %s\n' check result time "last line"
printf '%s\n' "${RESULTS[@]}"
! printf '%s\n' "${RESULTS[@]}" | grep -q ' FAIL '
