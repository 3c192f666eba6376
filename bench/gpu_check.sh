#!/usr/bin/env bash
# One-shot GPU check, fitted to the GPU machine it will meet: one command of at most 10 minutes, no network, and at
# most 8 files back from $OUT (16 MiB each, at most two folders down).
#
#   bash bench/gpu_prepare.sh                  # HERE first (network): the wheels the GPU image lacks, into .whl/
#   bash bench/gpu_check.sh                    # THERE (carry ".whl"): the check, <= 540 s
#   bash bench/gpu_check.sh --cpu-smoke        # anywhere: the same steps at tiny shapes on the CPU (a few minutes)
#
# Steps (sdvg/bench/gpu_check.py: STEPS, each with its own budget; the budgets add up to <= 540 s; every step is tried
# even if one fails; each writes its figures as it goes):
#   deps        diffusers and gguf from .whl/ (pip install --no-index --no-deps --target) when `import diffusers, gguf` fails
#   cuda_smoke  tiny models: reject-all == target-only bit-exact per cache regime, pipelined == plain, bf16 finite
#   plan        the 24 GiB card plan's line items (meta device)
#   real_size   random weights at the real 1.3B / 14B / VAE / ImageReward shapes, 832x480, bf16: per-call times,
#               speedup at forced acceptance vs the cost-model bound, pipelined vs plain, peak VRAM per row
#   offload     block offload (tiny, bit-exact) and a random 14B in fp8 at 832x480, 9 of 40 blocks resident vs all
#   train       Diagonal Distillation steps at the real 1.3B shapes: s/iter and peak memory vs the FSDP plan
#   quant       GGUF / scaled-fp8 DiTs: dequant kernels on the device vs gguf's numpy, quantized vs dequantized twin
# $OUT (default out/gpu_check): summary.json (every figure, each step's status and error), logs.tar.gz (step logs and
# the plan), cuda_smoke.json, real_size.json, real_size.png, offload.json, train.json, quant.json. Caches and logs live outside
# $OUT (SDVG_GPU_WORK, default a new folder under /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
WORK="${SDVG_GPU_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/sdvg-gpu-check-XXXXXX")}"
# the outer guard: the check keeps its own 540 s deadline; this only stops a hung interpreter before the 600 s cap
exec timeout -k 5 580 "$PY" -m sdvg.bench.gpu_check --out "$OUT" --work "$WORK" --wheels .whl "$@"
