#!/usr/bin/env bash
# Run HERE (with network to PyPI), before the GPU call: downloads the wheels the GPU image lacks into the git-ignored
# .whl/ folder and checks every wheel's requirements against the image's packages (bench/gpu_image_packages.txt).
#
#   bash bench/gpu_prepare.sh            # -> .whl/*.whl ; then the GPU call carries ".whl" and runs bench/gpu_check.sh
#
# The image (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, safetensors 0.8.0, huggingface_hub 1.33) lacks:
#   diffusers          the DiT and VAE layers (needs huggingface-hub>=1.32, safetensors>=0.8: both on the image)
#   importlib_metadata a declared requirement of diffusers (only imported on Python < 3.8; tiny, pure Python)
# av (PyAV) is absent too but not needed: the check writes no video (bench/gpu_check.sh runs without it).
# bench/gpu_check.sh installs them with `pip install --no-index --no-deps --target DIR` when `import diffusers` fails.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL="${WHL:-.whl}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
# name==version, one each (two versions of one package stop the whole install there)
WHEELS=(diffusers==0.42.1 importlib_metadata==8.7.0 gguf==0.19.0)
mkdir -p "$WHL"
# pip matches manylinux_2_N exactly: name the ones the image's glibc (2.39) covers; pure-Python wheels are py3-none-any
PLATFORMS=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done
# the local pip cap (/etc/xdg/pip constraints) is about torch only; a download names no torch
PIP_CONSTRAINT="" "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$WHL" "${WHEELS[@]}"
# drop wheels of other versions left from an earlier run
for w in "$WHL"/*.whl; do
    keep=0
    for spec in "${WHEELS[@]}"; do
        n="${spec%%==*}"; v="${spec##*==}"
        case "$(basename "$w")" in "${n}-${v}-"*) keep=1 ;; esac
    done
    [ "$keep" -eq 1 ] || { echo "removing stale $w"; rm -f "$w"; }
done
"$PY" bench/check_wheels.py "$WHL"
du -ch "$WHL"/*.whl | tail -1 | sed 's/total$/in .whl (the GPU call carries at most 64 MiB in all)/'
