#!/usr/bin/env bash
# One-shot GPU check (< ~10 minutes on one H200-class GPU):
#   1. CUDA smoke test of the engine on the tiny models (bench/cuda_smoke.py): reject-all == target-only bit-exact
#      per cache regime, pipelined == plain, bf16 generation finite;
#   2. the real-size speed benchmark: random weights at the real 1.3B / 14B / VAE / ImageReward shapes, 832x480,
#      bf16, 5 blocks (`python -m sdvg bench --profile real-size`);
#   3. block offload and LoRA merging on the GPU (bench/offload_lora_check.py): tiny offload bit-identical with the
#      side-stream prefetch, LoRA merge on the GPU == on the CPU, and a random 14B in fp8 at 832x480 with 9 of 40
#      blocks resident (the 24 GiB plan) vs all resident: bit-identical, seconds per forward, peak memory;
#   4. Diagonal Distillation training at the real 1.3B shapes with random weights (bench/train_real_size.py): a few
#      DMD steps (student, teacher, fake score, 832x480, 21 latent frames, bf16 autocast, gradient checkpointing):
#      seconds per iteration and peak memory beside the FSDP plan's one-GPU estimate;
#   5. GGUF and scaled-fp8 DiTs on the GPU (bench/quant_check.py): the torch dequant kernels on CUDA == gguf's numpy
#      reference, the tiny GGUF target == its dequantized twin bit for bit (also offloaded, side-stream prefetch),
#      scaled fp8 offloaded == resident, and forward times of the three.
# Results go to $OUT (default out/gpu_check): cuda_smoke.json, real_size.json, real_size.png, offload_lora.json,
# train_real_size.json, quant_check.json, logs, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
export SDVG_CACHE_DIR="${SDVG_CACHE_DIR:-$OUT/.sdvg-cache}"
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/env.txt" 2>&1 || true

timeout 180 "$PY" bench/cuda_smoke.py --out "$OUT/cuda_smoke.json" 2>&1 | tee "$OUT/cuda_smoke.log"
smoke=${PIPESTATUS[0]}

timeout 330 "$PY" -m sdvg bench --profile real-size --json "$OUT/real_size.json" --plot "$OUT/real_size.png" \
    2>&1 | tee "$OUT/real_size.log"
real=${PIPESTATUS[0]}

timeout 150 "$PY" bench/offload_lora_check.py --real --resident 9 --out "$OUT/offload_lora.json" \
    2>&1 | tee "$OUT/offload_lora.log"
offload=${PIPESTATUS[0]}

timeout 240 "$PY" bench/train_real_size.py --out "$OUT/train_real_size.json" 2>&1 | tee "$OUT/train_real_size.log"
train=${PIPESTATUS[0]}

timeout 120 "$PY" bench/quant_check.py --device cuda --dtype bf16 --out "$OUT/quant_check.json" \
    2>&1 | tee "$OUT/quant_check.log"
quant=${PIPESTATUS[0]}

echo "cuda_smoke rc=$smoke real_size rc=$real offload_lora rc=$offload train_real_size rc=$train quant rc=$quant" \
    "elapsed $(( $(date +%s) - start ))s" | tee "$OUT/summary.txt"
[ "$smoke" -eq 0 ] && [ "$real" -eq 0 ] && [ "$offload" -eq 0 ] && [ "$train" -eq 0 ] && [ "$quant" -eq 0 ]
