#!/usr/bin/env bash
# Compile the patched llama.cpp with CUDA (ggml-cuda + llama libraries) and report the wall time: the check
# that the patch series builds for NVIDIA GPUs on a machine without one. Not a runtime install (that is
# `python ggml_patches/build.py --cuda`).
#
#   ggml_patches/cuda_build.sh [BUILD_DIR]        # default /tmp/kvlocal-cuda-build
#   CUDA_ARCH=89 CUBLAS=/path/to/nvidia/cu13 ggml_patches/cuda_build.sh
#   WITH_TESTS=1 ggml_patches/cuda_build.sh       # also ggml's test-backend-ops (ggml_patches/gpu_check.sh)
#
# Needs nvcc, CMake, a C++ compiler and cuBLAS headers/libraries: the CUDA toolkit's own, or the
# `nvidia-cublas` wheel unpacked (`pip download nvidia-cublas`, unzip; CUBLAS=its nvidia/cu13 folder).
# GGML_CUDA_NO_VMM avoids linking libcuda, so no driver is needed. On 2 cores it takes most of an hour
# (ggml_patches/README.md has the times); it does not fit CI. GPU_LIBS=<BUILD_DIR>/build/bin ggml_patches/gpu_pack.sh packs the
# result for gpu_check.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-/tmp/kvlocal-cuda-build}"
arch="${CUDA_ARCH:-90}"
cache="${KVLOCAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlocal}"
sdist="$cache/src/llama_cpp_python-0.3.36.tar.gz"
[ -f "$sdist" ] || { echo "cuda_build.sh: $sdist is missing: run ./setup.sh (or ggml_patches/build.py) once" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "cuda_build.sh: nvcc not found: install the CUDA toolkit" >&2; exit 2; }

rm -rf "$out" && mkdir -p "$out"
tar xzf "$sdist" -C "$out"
tree="$out/llama_cpp_python-0.3.36/vendor/llama.cpp"
rm -f "$tree/.git"
for p in "$here"/[0-9][0-9][0-9][0-9]-*.patch; do
    patch -d "$tree" -p1 --forward --batch --quiet -i "$p"
done

flags=()
tests=$([ "${WITH_TESTS:-0}" = 1 ] && echo ON || echo OFF)
if [ -n "${CUBLAS:-}" ]; then
    for lib in "$CUBLAS"/lib/lib*.so.*; do  # the wheel ships versioned names only
        ln -sf "$(basename "$lib")" "${lib%%.so.*}.so"
    done
    flags+=("-DCMAKE_LIBRARY_PATH=$CUBLAS/lib" "-DCMAKE_CUDA_FLAGS=-I$CUBLAS/include" "-DCMAKE_CXX_FLAGS=-I$CUBLAS/include")
fi
cmake -S "$tree" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_NO_VMM=ON "${flags[@]}" \
    -DLLAMA_BUILD_TESTS="$tests" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_COMMON="$tests" -DLLAMA_CURL=OFF >"$out/configure.log"
start=$(date +%s)
cmake --build "$out/build" --target ggml-cuda llama $([ "$tests" = ON ] && echo test-backend-ops) -j "$(nproc)"
echo "cuda_build.sh: ggml-cuda and llama built for sm_$arch in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s: $out/build/bin"
