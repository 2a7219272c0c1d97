#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: check the per-head attention bias (patches 0005-0008) on the CUDA kernels.
#   1. ggml's own test: the FLASH_ATTN_EXT cases with a bias (test-backend-ops, patch 0007) on CUDA against
#      the CPU, and once without the bias (the existing kernels are unchanged);
#   2. kvlocal's tests of the bias with the model offloaded (tests/test_bias.py, KVLOCAL_TEST_NGL).
# Needs the CUDA toolkit with cuBLAS; takes one CUDA build (ggml_patches/cuda_build.sh) and one wheel build.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-/tmp/kvlocal-cuda-check}"
KVLOCAL_BUILD_ARGS="--cuda" ./setup.sh
WITH_TESTS=1 ggml_patches/cuda_build.sh "$build"
ops="$build/build/bin/test-backend-ops"
"$ops" -b CUDA0 -o FLASH_ATTN_EXT -p 'bias=1'
"$ops" -b CUDA0 -o FLASH_ATTN_EXT
KVLOCAL_TEST_NGL=99 .venv/bin/python -m pytest -q tests/test_bias.py
echo "gpu_check.sh: the attention bias passed on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
