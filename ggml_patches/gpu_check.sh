#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, offline, in one command of at most 10 minutes: check the patched llama.cpp and the
# native backend on the GPU and measure compression on a random-weight model of Llama-3-8B's shape.
#
#   ggml_patches/gpu_pack.sh            # first, on a machine with the repo set up: writes .gpu/ (~7 MiB; with
#                                       # GPU_LIBS=<cuda_build.sh's bin>, the CUDA libraries built there: 42 MiB)
#   ggml_patches/gpu_check.sh           # then, on the GPU machine, in a copy of the repo with .gpu/
#   DRY_RUN=1 ggml_patches/gpu_check.sh # the steps and their time budgets, nothing run
#
# Every step runs under `timeout` with its budget (the table below; they add up to at most 9 minutes, so one
# 10-minute command holds them with time to spare); a step that could no longer finish inside the total is skipped,
# a failing or timed-out step is reported and the next one runs. Each step's output is on the terminal and in
# RESULTS/NAME.txt (RESULTS: $OUT/gpu-check when OUT is set — a device machine returns only what is under $OUT —
# else GPU_WORK/results), with steps.tsv: each step's budget, seconds used and status. SHAPE=tiny, TESTS=0 and
# small TOKENS and CONTEXTS try the pipeline in a minute on a CPU (tests/patches/test_gpu_check.py does, with a pack of the
# CPU libraries, and BUDGET_SCALE=4: every budget and the total times 4, for a slower machine).
#
# The steps:
#   libraries    the ggml-cuda and llama libraries: the ones in .gpu/bin.tar.xz (built elsewhere by cuda_build.sh for
#                this GPU's architecture); else built here from .gpu/llama.cpp.tar.gz — longer than one command
#                (BUILD_BUDGET, default 540 s: the later steps are then skipped; run the script again, the build stays)
#   backend-ops  ggml's test-backend-ops, the attention-bias cases of FLASH_ATTN_EXT (patch 0004), CUDA against the
#                CPU: each case's status counted; a failure, or a case "not supported" other than ALiBi's (left to
#                the CPU by patch 0005), fails the step
#   setup        kvlocal from this checkout with the pack's Python packages; `kvlocal doctor`
#   tests        tests/backends/test_native.py and test_native_scale.py on generated models with the cache on the GPU
#                (KVLOCAL_TEST_NGL=99) and TF32 off
#                (NVIDIA_TF32_OVERRIDE=0: cuBLAS's TF32 would round the score's products to 10 bits and make the
#                native-against-state comparisons differ for no bug); quantized merges compared after dequantizing
#   bias         the attention bias end to end in llama at head sizes 64 and 128, flash attention on and off:
#                next-token distributions with -ngl 99 against -ngl 0 (ggml_patches/gpu_steps.py bias), TF32 off
#   gguf         a random-weight GGUF of SHAPE (default llama3-8b: 4.3 GiB, Q4_0; ggml_patches/random_gguf.py)
#   sched        a compaction, a score, a merge and a biased decode on it with GGML_SCHED_DEBUG=2: every graph node
#                the scheduler puts on the CPU (the token lookup apart) is listed and fails the step
#   bench        `kvlocal bench --json` on it: TOKENS (default 32704) tokens at budget 0.1, CriticalKV on the native
#                backend, -ngl 99, against the full cache; ms per event, TTFT, decode tok/s, KV bytes, and backend
#                transfers per event where the bench reports them
#   bench-adakv  the same with criticalkv+adakv at half the tokens: its per-head budgets decode through the
#                attention bias (0005)
#   frontier     `kvlocal bench --frontier` at CONTEXTS (default 8192): the full F16 cache, q8_0 and q4_0 caches,
#                criticalkv at 0.1 and on a q8_0 cache
# Needs: the CUDA runtime and cuBLAS (a CUDA toolkit; nvcc, CMake and a C++ compiler too when it builds), Python 3
# with numpy, jinja2, tqdm and pytest (a stock CUDA/PyTorch image has them; the tests run in one process, without
# pytest-xdist; gguf, diskcache, threadpoolctl and cffi come as wheels in the pack); nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
export repo=$PWD
export pack="${GPU_PACK:-$repo/.gpu}" work="${GPU_WORK:-/tmp/kvlocal-gpu}" py="${PYTHON:-python3}"
export tokens="${TOKENS:-32704}" contexts="${CONTEXTS:-8192}" shape="${SHAPE:-llama3-8b}"
results="${RESULTS:-${OUT:+$OUT/gpu-check}}"
export results="${results:-$work/results}"
export model="$work/random-$shape.gguf"
scale="${BUDGET_SCALE:-1}"
total=$((540 * scale))  # seconds: what the steps' budgets may add up to

built=$([ -f "$pack/llama.cpp.tar.gz" ] && [ ! -f "$pack/bin.tar.xz" ] && echo "${BUILD_BUDGET:-540}" || echo 30)
# name|budget in seconds|what: estimates for an H100 with 16 cores, the pack holding prebuilt libraries
steps=(
    "libraries|$built|the prebuilt ggml-cuda and llama libraries unpacked (nvidia-smi)"
    "backend-ops|40|test-backend-ops -o FLASH_ATTN_EXT -p bias=1 on CUDA0: 202 cases against the CPU"
    "setup|15|the pack's Python packages; kvlocal doctor"
    "tests|100|tests/backends/test_native.py and test_native_scale.py on generated models: KVLOCAL_TEST_NGL=99, TF32 off"
    "bias|30|the bias in llama, head sizes 64 and 128, FA on/off: -ngl 99 against -ngl 0"
    "gguf|30|a random-weight GGUF of $shape's shape"
    "sched|40|compaction, score, merge, biased decode: nodes the scheduler puts on the CPU"
    "bench|120|kvlocal bench --json: $tokens tokens, criticalkv at 0.1, native, -ngl 99"
    "bench-adakv|60|the same with criticalkv+adakv at $((tokens / 2)) tokens (per-head budgets through the bias)"
    "frontier|40|kvlocal bench --frontier --contexts $contexts: 5 configurations each"
)

budget_of() {
    local line secs
    for line in "${steps[@]}"; do
        if [ "${line%%|*}" = "$1" ]; then IFS="|" read -r _ secs _ <<<"$line"; echo $((secs * scale)); return; fi
    done
    echo "gpu_check.sh: no step $1 in the budget table" >&2
    exit 2
}

budget_table() {
    local line name secs what sum=0
    printf '%-12s %6s  %s\n' step budget what
    for line in "${steps[@]}"; do
        IFS='|' read -r name secs what <<<"$line"
        printf '%-12s %5ss  %s\n' "$name" $((secs * scale)) "$what"
        sum=$((sum + secs * scale))
    done
    printf '%-12s %5ss  of at most %s s (9 minutes%s: one 10-minute command with a minute to spare)\n' total "$sum" \
        "$total" "$([ "$scale" = 1 ] || echo " × BUDGET_SCALE $scale")"
}

echo "gpu_check.sh: the steps and their time budgets"
budget_table
if [ "${DRY_RUN:-0}" = 1 ]; then exit 0; fi
[ -f "$pack/llama.cpp.tar.gz" ] || [ -f "$pack/bin.tar.xz" ] || { echo "gpu_check.sh: $pack holds neither llama.cpp.tar.gz nor bin.tar.xz: run ggml_patches/gpu_pack.sh first" >&2; exit 2; }
mkdir -p "$work" "$results"
: >"$results/steps.tsv"
t0=$(date +%s)
failed=0

# run_step NAME COMMAND...: COMMAND (a command or a function below) under `timeout` with NAME's budget, its output
# on the terminal and in $results/NAME.txt, its budget, seconds and status in $results/steps.tsv
run_step() {
    local name=$1 secs start rc status
    shift
    secs=$(budget_of "$name")
    if (( $(date +%s) - t0 + secs > total )); then
        echo "!! $name skipped: its ${secs} s would end past the ${total} s of all steps"
        printf '%s\t%s\t0\tskipped\n' "$name" "$secs" >>"$results/steps.tsv"
        failed=1
        return
    fi
    echo "== $name (budget ${secs} s; at $(( $(date +%s) - t0 )) s)"
    if declare -F "$1" >/dev/null; then set -- bash -c '"$0" "$@"' "$@"; fi  # a function of this script
    start=$(date +%s)
    set +e
    timeout -k 5 "$secs" "$@" 2>&1 | tee "$results/$name.txt"
    rc=${PIPESTATUS[0]}
    set -e
    case $rc in
        0) status=ok ;;
        124|137) status="timed out after ${secs} s"; failed=1 ;;
        *) status="failed (exit $rc)"; failed=1 ;;
    esac
    [ "$status" = ok ] || echo "!! $name $status"
    printf '%s\t%s\t%s\t%s\n' "$name" "$secs" "$(( $(date +%s) - start ))" "$status" >>"$results/steps.tsv"
}

libraries() {
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo "no GPU"
    if [ -f "$pack/bin.tar.xz" ]; then
        tar xJf "$pack/bin.tar.xz" -C "$work"
        for f in "$bin"/lib*.so.*; do  # the pack holds each library under its soname; llama_cpp loads lib*.so
            ln -sf "$(basename "$f")" "${f%%.so.*}.so"
        done
        echo "prebuilt: $(cat "$bin/BUILT")"
        return
    fi
    command -v nvcc >/dev/null || { echo "gpu_check.sh: nvcc not found: install the CUDA toolkit" >&2; return 2; }
    local arch
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
    mkdir -p "$work/src" && tar xzf "$pack/llama.cpp.tar.gz" -C "$work/src"
    cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_COMMON=ON \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF >"$work/configure.log"
    cmake --build "$work/build" --target ggml-cuda llama test-backend-ops -j "$(nproc)" >"$work/build.log"
}

backend_ops() {  # the bias cases' statuses, counted from the log (test-backend-ops counts "not supported" as passed)
    local rc=0
    "$bin/test-backend-ops" -b CUDA0 -o FLASH_ATTN_EXT -p 'bias=1' >"$results/backend-ops.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || tail -20 "$results/backend-ops.log"
    "$py" ggml_patches/gpu_steps.py backend-ops "$results/backend-ops.log" || rc=1
    return "$rc"
}

setup() {  # kvlocal from this checkout, llama-cpp-python's Python package from the pack, its library from $bin
    "$py" -m pip install -q --no-index --no-deps --target "$work/site" "$pack"/wheels/*.whl
    if ! ls kvlocal/_kernels*.so >/dev/null 2>&1; then cp "$pack"/_kernels*.so kvlocal/; fi  # ignored by git: not copied
    "$py" -m kvlocal doctor
}

gguf() {
    [ -f "$model" ] || "$py" ggml_patches/random_gguf.py "$model" --shape "$shape"
}

bench_json() {  # NAME METHOD TOKENS: kvlocal bench --json into $results/NAME.json, then its figures
    "$py" -m kvlocal bench "$model" --long "$3" --decode 64 --budget 0.1 -ngl 99 --method "$2" --backends native \
        --json >"$results/$1.json"
    "$py" ggml_patches/gpu_steps.py bench "$results/$1.json"
}

# cuBLAS and the CUDA runtime: the toolkit's, else the nvidia-* Python packages' (a PyTorch image)
for d in /usr/local/cuda/lib64 $("$py" -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null || true); do
    if [ -d "$d" ]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
export bin=$([ -f "$pack/bin.tar.xz" ] && echo "$work/bin" || echo "$work/build/bin")
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # a build elsewhere: its run paths name that machine's folders
export PYTHONPATH="$repo:$work/site:$pack${PYTHONPATH:+:$PYTHONPATH}" LLAMA_CPP_LIB_PATH="$bin" CI=
export -f libraries backend_ops setup gguf bench_json

run_step libraries libraries
if [ -x "$bin/test-backend-ops" ]; then
    run_step backend-ops backend_ops
else
    echo "== backend-ops: skipped (no test-backend-ops in $bin)"
fi
run_step setup setup
if [ "${TESTS:-1}" = 1 ]; then  # the tests on generated models (the registry's SmolLM2 cannot be had offline)
    # then test_native_scale.py's: graphs of any size, the decode's buffer and graph reuse across an event, rows in one copy
    # per tensor, and 16,384 cells at Llama-3-8B's attention shape against numpy
    run_step tests env KVLOCAL_TEST_NGL=99 NVIDIA_TF32_OVERRIDE=0 sh -c '"$0" -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/backends/test_native.py -k "not smollm2 and not refuses_bad_indices and not score_ and not backend_choice and not cli_backend_flag" \
        && "$0" -m pytest -q -p no:cacheprovider -o addopts="" tests/backends/test_native_scale.py' "$py"
else
    echo "== tests: skipped (TESTS=0)"
fi
run_step bias env NVIDIA_TF32_OVERRIDE=0 "$py" ggml_patches/gpu_steps.py bias "$work"
run_step gguf gguf
run_step sched env GGML_SCHED_DEBUG=2 "$py" ggml_patches/gpu_steps.py sched "$model"
run_step bench bench_json bench criticalkv "$tokens"
run_step bench-adakv bench_json bench-adakv criticalkv+adakv $((tokens / 2))
# shellcheck disable=SC2086
run_step frontier "$py" -m kvlocal bench "$model" --frontier --contexts $contexts --decode 64 --budget 0.1 -ngl 99 \
    --plot "$results/frontier.png"

echo "== done in $(( $(date +%s) - t0 )) s of ${total}$([ "$failed" = 1 ] && echo ': a step failed or was skipped, above')"
printf '%-12s %6s %6s  %s\n' step budget used status
while IFS=$'\t' read -r name secs used status; do
    printf '%-12s %5ss %5ss  %s\n' "$name" "$secs" "$used" "$status"
done <"$results/steps.tsv"
echo "results: $results"
exit "$failed"
