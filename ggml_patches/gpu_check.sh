#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, offline: check the patched llama.cpp and the native backend on it and measure
# compression at 32K tokens on a random-weight model of Llama-3-8B's shape.
#
#   ggml_patches/gpu_pack.sh            # first, on a machine with the repo set up: writes .gpu/ (~7 MiB; with
#                                       # GPU_LIBS=<cuda_build.sh's bin>, the CUDA libraries built there: 42 MiB)
#   ggml_patches/gpu_check.sh           # then, on the GPU machine, in a copy of the repo with .gpu/
#
# Steps (each prints its wall time; RESULTS=DIR keeps each step's output there as a file; SHAPE=tiny, TESTS=0 and
# small TOKENS and CONTEXTS try the pipeline in seconds — tests/test_gpu_check.py does, with a pack of the CPU
# libraries):
#   1. the ggml-cuda and llama libraries: the ones in .gpu/bin.tar.xz when the pack has them (built elsewhere by
#      ggml_patches/cuda_build.sh for this GPU's architecture), else built here from .gpu/llama.cpp.tar.gz with
#      the flash-attention kernels — patch 0008's attention bias lives there — and ggml's test-backend-ops, whose
#      attention-bias cases (patch 0007) run against the CPU (FA=0: a build a third as long, 0008 unbuilt);
#   2. kvlocal's native-backend tests with the cache on the GPU (tests/test_native.py on generated models,
#      KVLOCAL_TEST_NGL=99): the device's compaction moves and copies the same rows, bit for bit; native keeps the
#      same sets as state, merges alike and recalls the same rows (F32 and quantized caches, the bias's kernels);
#   3. a random-weight GGUF of Llama-3-8B's shape (ggml_patches/random_gguf.py, Q4_0, 4.3 GiB);
#   4. `kvlocal bench` on it: TOKENS (default 32704) tokens at budget 0.1 with CriticalKV on the native
#      backend, fully offloaded, against the full cache: milliseconds per compression event, TTFT with and
#      without compression, decode tokens/s, KV bytes; then the same with criticalkv+adakv, whose per-head
#      budgets decode through the attention bias (patch 0008);
#   5. `kvlocal bench --frontier` at CONTEXTS (default 8192 16384 32768): the full F16 cache, the q8_0 and q4_0
#      K+V caches, criticalkv at 0.1 and criticalkv on a q8_0 cache, on the GPU;
#   6. with STATE=1, step 4's bench on the state backend (the cache crosses PCIe at every event).
# Needs: the CUDA runtime and cuBLAS (a CUDA toolkit; nvcc, CMake and a C++ compiler too when it builds), Python 3
# with numpy, jinja2, tqdm and pytest (a stock CUDA/PyTorch image has them; the tests run in one process, without
# pytest-xdist; gguf, diskcache, threadpoolctl and cffi come as wheels in the pack); nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
pack="${GPU_PACK:-$repo/.gpu}"
work="${GPU_WORK:-/tmp/kvlocal-gpu}"
tokens="${TOKENS:-32704}"
contexts="${CONTEXTS:-8192 16384 32768}"
results="${RESULTS:-$work/results}"
py="${PYTHON:-python3}"
[ -f "$pack/llama.cpp.tar.gz" ] || [ -f "$pack/bin.tar.xz" ] || { echo "gpu_check.sh: $pack holds neither llama.cpp.tar.gz nor bin.tar.xz: run ggml_patches/gpu_pack.sh first" >&2; exit 2; }
mkdir -p "$work" "$results"
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
# a step's output on the terminal and in $results/NAME.txt; a failing step is reported and the next one runs
failed=0
run_step() { local name=$1; shift; if ! "$@" 2>&1 | tee "$results/$name.txt"; then echo "!! $name failed"; failed=1; fi; }

step "1. libraries for $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU')"
# cuBLAS and the CUDA runtime: the toolkit's, else the nvidia-* Python packages' (a PyTorch image)
for d in /usr/local/cuda/lib64 $("$py" -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null || true); do
    if [ -d "$d" ]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
if [ -f "$pack/bin.tar.xz" ]; then
    tar xJf "$pack/bin.tar.xz" -C "$work"
    bin="$work/bin"
    for f in "$bin"/lib*.so.*; do  # the pack holds each library under its soname; llama_cpp loads lib*.so
        ln -sf "$(basename "$f")" "${f%%.so.*}.so"
    done
    echo "prebuilt: $(cat "$bin/BUILT")"
else
    command -v nvcc >/dev/null || { echo "gpu_check.sh: nvcc not found: install the CUDA toolkit" >&2; exit 2; }
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
    mkdir -p "$work/src" && tar xzf "$pack/llama.cpp.tar.gz" -C "$work/src"
    fa=$([ "${FA:-1}" = 1 ] && echo ON || echo OFF)
    cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_FA="$fa" -DLLAMA_BUILD_TESTS="$fa" \
        -DLLAMA_BUILD_COMMON="$fa" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log"
    cmake --build "$work/build" --target ggml-cuda llama $([ "$fa" = ON ] && echo test-backend-ops) -j "$(nproc)" >"$work/build.log"
    bin="$work/build/bin"
fi
step "libraries: $bin"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # a build elsewhere: its run paths name that machine's folders
if [ -x "$bin/test-backend-ops" ]; then
    run_step test-backend-ops "$bin/test-backend-ops" -b CUDA0 -o FLASH_ATTN_EXT -p 'bias=1'
fi

# kvlocal from this checkout, llama-cpp-python's Python package from the pack, its library from $bin
"$py" -m pip install -q --no-index --no-deps --target "$work/site" "$pack"/wheels/*.whl
if ! ls kvlocal/_kernels*.so >/dev/null 2>&1; then cp "$pack"/_kernels*.so kvlocal/; fi  # ignored by git: not copied
export PYTHONPATH="$repo:$work/site:$pack${PYTHONPATH:+:$PYTHONPATH}" LLAMA_CPP_LIB_PATH="$bin" CI=
"$py" -m kvlocal doctor

step "2. native backend tests with the cache on the GPU$([ "${TESTS:-1}" = 1 ] || echo ': skipped (TESTS=0)')"
if [ "${TESTS:-1}" = 1 ]; then  # the tests on generated models (the registry's SmolLM2 cannot be had offline)
    run_step tests env KVLOCAL_TEST_NGL=99 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_native.py \
        -k "not smollm2 and not refuses_bad_indices and not score_ and not backend_choice and not cli_backend_flag"
fi

step "3. a random-weight GGUF of ${SHAPE:-llama3-8b}'s shape"
model="$work/random-${SHAPE:-llama3-8b}.gguf"
[ -f "$model" ] || "$py" ggml_patches/random_gguf.py "$model" --shape "${SHAPE:-llama3-8b}"

step "4. kvlocal bench: $tokens tokens, budget 0.1, -ngl 99"
run_step bench "$py" -m kvlocal bench "$model" --long "$tokens" --decode 64 --budget 0.1 -ngl 99 --backends native
run_step bench-adakv "$py" -m kvlocal bench "$model" --long "$tokens" --decode 64 --budget 0.1 -ngl 99 \
    --method criticalkv+adakv --backends native

step "5. kvlocal bench --frontier: $contexts tokens, -ngl 99"
# shellcheck disable=SC2086
run_step frontier "$py" -m kvlocal bench "$model" --frontier --contexts $contexts --decode 64 --budget 0.1 -ngl 99 \
    --plot "$results/frontier.png"
if [ "${STATE:-0}" = 1 ]; then
    step "6. kvlocal bench: $tokens tokens on the state backend (the cache to the host and back at every event)"
    run_step bench-state "$py" -m kvlocal bench "$model" --long "$tokens" --decode 64 --budget 0.1 -ngl 99 --backends state
fi
step "done$([ "$failed" = 1 ] && echo ': a step failed, above')"
exit "$failed"
