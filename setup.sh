#!/usr/bin/env bash
# Set up kvlocal in ./.venv: the patched llama.cpp runtime (built once, then cached), the package with
# its native kernels, and the test/reference extras. Safe to run again; a second run takes seconds.
#   KVLOCAL_BUILD_ARGS="--cuda" ./setup.sh     # flags for ggml_patches/build.py (--cuda, --native, --cmake-args=...)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools cffi
# shellcheck disable=SC2086
.venv/bin/python ggml_patches/build.py ${KVLOCAL_BUILD_ARGS:-}
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/kvlocal doctor
