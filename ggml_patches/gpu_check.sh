#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, offline: build the patched llama.cpp for that GPU, check the native
# backend on it and measure compression at 32K tokens on a random-weight model of Llama-3-8B's shape.
#
#   ggml_patches/gpu_pack.sh            # first, on a machine with the repo set up: writes .gpu/ (~7 MiB)
#   ggml_patches/gpu_check.sh           # then, on the GPU machine, in a copy of the repo with .gpu/
#
# Steps (each prints its wall time):
#   1. build the ggml-cuda and llama libraries from .gpu/llama.cpp.tar.gz for the local GPU's architecture
#      with the flash-attention kernels — patch 0008's attention bias lives there — and ggml's
#      test-backend-ops, whose attention-bias cases (patch 0007) run against the CPU; FA=0 skips both for a
#      build a third as long, which leaves 0008 unbuilt and unchecked);
#   2. kvlocal's native-backend tests with the cache on the GPU (tests/test_native.py on generated models,
#      KVLOCAL_TEST_NGL=99): the device's compaction moves the same rows, native keeps the same sets as state;
#   3. a random-weight GGUF of Llama-3-8B's shape (ggml_patches/random_gguf.py, Q4_0, 4.3 GiB);
#   4. `kvlocal bench` on it: TOKENS (default 32704) tokens at budget 0.1 with CriticalKV on the native
#      backend, fully offloaded, against the full cache: milliseconds per compression event, TTFT with and
#      without compression, decode tokens/s, KV bytes. STATE=1 adds the state backend (K/V over PCIe).
# Needs: nvcc and cuBLAS (the CUDA toolkit), CMake, a C++ compiler, Python 3 with numpy, jinja2, tqdm and
# pytest (a stock CUDA/PyTorch image has them; the tests run in one process, without pytest-xdist); nothing is
# downloaded. Aimed at under 10 minutes on 16 cores with FA=0, longer with the default FA=1; not yet timed: no
# GPU was available to this project.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
pack="${GPU_PACK:-$repo/.gpu}"
work="${GPU_WORK:-/tmp/kvlocal-gpu}"
tokens="${TOKENS:-32704}"
py="${PYTHON:-python3}"
[ -f "$pack/llama.cpp.tar.gz" ] || { echo "gpu_check.sh: $pack/llama.cpp.tar.gz is missing: run ggml_patches/gpu_pack.sh first" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "gpu_check.sh: nvcc not found: install the CUDA toolkit" >&2; exit 2; }
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

step "1. build for $(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -1)"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
mkdir -p "$work/src" && tar xzf "$pack/llama.cpp.tar.gz" -C "$work/src"
fa=$([ "${FA:-1}" = 1 ] && echo ON || echo OFF)
cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_FA="$fa" -DLLAMA_BUILD_TESTS="$fa" \
    -DLLAMA_BUILD_COMMON="$fa" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log"
cmake --build "$work/build" --target ggml-cuda llama $([ "$fa" = ON ] && echo test-backend-ops) -j "$(nproc)" >"$work/build.log"
step "built: $work/build/bin"
if [ "$fa" = ON ]; then
    "$work/build/bin/test-backend-ops" -b CUDA0 -o FLASH_ATTN_EXT -p 'bias=1'
fi

# kvlocal from this checkout, llama-cpp-python's Python package from the pack, its library from the build
"$py" -m pip install -q --no-index --no-deps --target "$work/site" "$pack"/wheels/*.whl
cp "$pack"/_kernels*.so kvlocal/
export PYTHONPATH="$repo:$work/site:$pack${PYTHONPATH:+:$PYTHONPATH}" LLAMA_CPP_LIB_PATH="$work/build/bin" CI=
"$py" -m kvlocal doctor

step "2. native backend tests with the cache on the GPU"
KVLOCAL_TEST_NGL=99 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_native.py -k "compact_moves or tiny_f32"

step "3. a random-weight GGUF of Llama-3-8B's shape"
model="$work/random-llama3-8b.gguf"
[ -f "$model" ] || "$py" ggml_patches/random_gguf.py "$model"

step "4. kvlocal bench: $tokens tokens, budget 0.1, criticalkv, -ngl 99"
"$py" -m kvlocal bench "$model" --long "$tokens" --decode 64 --budget 0.1 -ngl 99 \
    --backends native $([ "${STATE:-0}" = 1 ] && echo state)
step "done"
