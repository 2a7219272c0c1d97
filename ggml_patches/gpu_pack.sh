#!/usr/bin/env bash
# Pack what ggml_patches/gpu_check.sh needs on an offline GPU machine, next to this repo's checkout:
#   ggml_patches/gpu_pack.sh [OUT]          # default .gpu (git-ignored); then copy the repo with OUT
#   GPU_LIBS=/tmp/kvlocal-cuda-build/build/bin ggml_patches/gpu_pack.sh    # with libraries cuda_build.sh built
# OUT holds (about 8 MiB): the patched llama.cpp sources a CUDA build needs (not the 77 MB source package),
# llama-cpp-python's Python package (its library comes from that build through LLAMA_CPP_LIB_PATH), the wheels
# of the Python packages a stock CUDA/PyTorch image lacks (gguf, diskcache, cffi for GPU_PYTHON, default 3.12)
# and kvlocal's compiled C kernels (abi3: any CPython 3). With GPU_LIBS (ggml_patches/cuda_build.sh's bin, built
# with WITH_TESTS=1 for this GPU's architecture) OUT/bin.tar.xz replaces the sources: the ggml, ggml-cuda and
# llama libraries and test-backend-ops, stripped (41 MiB for sm_90), so the GPU machine builds nothing.
# Run it where ./setup.sh has run (the source package is in the kvlocal cache).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
out="$(realpath -m "${1:-$repo/.gpu}")"
cache="${KVLOCAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlocal}"
sdist="$cache/src/llama_cpp_python-0.3.36.tar.gz"
[ -f "$sdist" ] || { echo "gpu_pack.sh: $sdist is missing: run ./setup.sh once" >&2; exit 2; }
kernels=$(ls "$repo"/kvlocal/_kernels*.so 2>/dev/null | head -1 || true)
[ -n "$kernels" ] || { echo "gpu_pack.sh: kvlocal's C kernels are not built: run ./setup.sh once" >&2; exit 2; }
libs="${GPU_LIBS:-}"
[ -z "$libs" ] || [ -f "$libs/libllama.so" ] || { echo "gpu_pack.sh: $libs/libllama.so is missing: run ggml_patches/cuda_build.sh (WITH_TESTS=1 for test-backend-ops)" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src="$tmp/llama_cpp_python-0.3.36"
tree="$src/vendor/llama.cpp"
if [ -n "$libs" ]; then  # built already: only llama-cpp-python's Python package is needed from the sources
    tar xzf "$sdist" -C "$tmp" llama_cpp_python-0.3.36/llama_cpp
else
    tar xzf "$sdist" -C "$tmp"
    for p in "$here"/[0-9][0-9][0-9][0-9]-*.patch; do
        patch -d "$tree" -p1 --forward --batch --quiet -i "$p"
    done
fi
rm -rf "$out" && mkdir -p "$out/wheels"
cp -r "$src/llama_cpp" "$out/llama_cpp"
find "$out/llama_cpp" -name '*.so' -delete
if [ -n "$libs" ]; then  # the libraries, xz-compressed (60 MiB of sm_90 code in libggml-cuda: 38 MiB packed)
    mkdir -p "$tmp/bin"
    for f in "$libs"/lib*.so; do  # each library once, under the name its users load (a soname: lib*.so.0)
        so=$(objdump -p "$f" | awk '/SONAME/ {print $2}')
        cp -L "$f" "$tmp/bin/${so:-$(basename "$f")}"
    done
    if [ -x "$libs/test-backend-ops" ]; then cp "$libs/test-backend-ops" "$tmp/bin/"; fi
    strip --strip-unneeded "$tmp"/bin/*
    arch=$(grep -h '^CMAKE_CUDA_ARCHITECTURES' "$libs/../CMakeCache.txt" 2>/dev/null | sed 's/.*=/sm_/' || true)
    echo "${arch:-no CUDA}, built $(date -u -r "$libs/libllama.so" +%F)" >"$tmp/bin/BUILT"
    tar cf - -C "$tmp" bin | xz -T0 -6 >"$out/bin.tar.xz"
else
    # the sources of the ggml and llama libraries and of ggml's test-backend-ops
    tar czf "$out/llama.cpp.tar.gz" -C "$tree" CMakeLists.txt cmake ggml src include common vendor tests licenses LICENSE
fi
cp "$kernels" "$out/"
version() { "$repo/.venv/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# pure-Python wheels, and cffi's compiled backend (the kernels import it) for the GPU image's CPython
"$repo/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" \
    "gguf==$(version gguf)" "diskcache==$(version diskcache)" "threadpoolctl==$(version threadpoolctl)"
"$repo/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" \
    --python-version "${GPU_PYTHON:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "cffi==$(version cffi)"
du -sh "$out"
