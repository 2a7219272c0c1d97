#!/usr/bin/env python3
"""Build and install llama-cpp-python from its pinned source package with kvlocal's patch series.

    python ggml_patches/build.py                 # CPU build (portable: AVX2/FMA/F16C, no -march=native)
    python ggml_patches/build.py --native        # -march=native (only where the CPU's advertised features work)
    python ggml_patches/build.py --cuda          # -DGGML_CUDA=on
    python ggml_patches/build.py --cmake-args="-DGGML_AVX512=on"
    python ggml_patches/build.py --stock DIR     # the same build WITHOUT the patches, installed into DIR
                                                 # (pip --target), for tests that compare against stock

Steps: download the source package with pip (checked against its sha256), unpack it, apply
ggml_patches/0*.patch to the vendored llama.cpp in order, build a wheel, install it into the running
Python. Metal is switched on by llama-cpp-python's own build on macOS/arm64.

The wheel is kept in the kvlocal cache under a key made of the source hash, the patches and the
CMake flags, so a second run with the same inputs installs in seconds. --rebuild ignores it.

Why GGML_NATIVE=OFF by default: on some virtual machines the CPU advertises AMX but a -march=native
build segfaults at the first decode inside ggml's AMX code; a portable build avoids it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# what the build leaves out: multimodal (llava/mtmd), tests, examples, tools, server
BASE_CMAKE = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]

HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    if os.environ.get("KVLOCAL_CACHE"):
        return Path(os.environ["KVLOCAL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlocal"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fail(msg: str) -> None:
    print(f"build.py: {msg}", file=sys.stderr)
    sys.exit(2)


def step(msg: str) -> None:
    print(f"[kvlocal build] {msg}", flush=True)


def fetch_sdist(dest: Path) -> Path:
    path = dest / SDIST
    if path.exists() and sha256(path) == SDIST_SHA256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    step(f"downloading {PACKAGE}=={VERSION} source")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    if subprocess.run(cmd).returncode != 0:
        fail(f"could not download {PACKAGE}=={VERSION}: check the network / pip configuration and rerun")
    got = sha256(path)
    if got != SDIST_SHA256:
        path.unlink()
        fail(f"{SDIST} has sha256 {got}, expected {SDIST_SHA256}; the corrupt file was deleted, rerun to fetch it again")
    return path


def patches() -> list[Path]:
    return sorted(HERE.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def build_key(cmake_args: list[str], stock: bool = False) -> str:
    h = hashlib.sha256(SDIST_SHA256.encode())
    for p in [] if stock else patches():
        h.update(p.name.encode() + p.read_bytes())
    h.update(" ".join(cmake_args).encode())
    h.update(f"{sys.version_info[0]}.{sys.version_info[1]}".encode())
    return h.hexdigest()[:16]


def apply_patches(tree: Path, stock: bool = False) -> None:
    llama = tree / "vendor" / "llama.cpp"
    (llama / ".git").unlink(missing_ok=True)  # a submodule pointer that git apply would trip over
    for p in [] if stock else patches():
        step(f"applying {p.name}")
        if shutil.which("patch"):
            cmd, cwd = ["patch", "-p1", "--forward", "--batch", "-i", str(p)], llama
        else:  # the source package carries a .git of its own: apply from its root
            cmd, cwd = ["git", "apply", "-p1", "--directory=vendor/llama.cpp", str(p)], tree
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{p.name} does not apply to the vendored llama.cpp:\n{r.stdout}{r.stderr}")


def build_wheel(sdist: Path, cmake_args: list[str], out: Path, jobs: int, stock: bool = False) -> Path:
    with tempfile.TemporaryDirectory(prefix="kvlocal-build-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        tree = Path(tmp) / f"llama_cpp_python-{VERSION}"
        apply_patches(tree, stock)
        env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args), CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
        step(f"compiling llama.cpp ({' '.join(cmake_args)}); this takes several minutes")
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(tree)]
        if subprocess.run(cmd, env=env).returncode != 0:
            shutil.rmtree(out, ignore_errors=True)
            fail("the llama.cpp build failed (see the compiler output above); a C/C++ compiler and CMake are needed")
    wheels = list(out.glob("llama_cpp_python-*.whl"))
    if not wheels:
        fail("the build produced no wheel")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--native", action="store_true", help="optimise for this CPU (-DGGML_NATIVE=ON)")
    ap.add_argument("--cuda", action="store_true", help="build the CUDA backend (-DGGML_CUDA=on)")
    ap.add_argument("--cmake-args", default="", help="extra CMake flags, appended last")
    ap.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--stock", metavar="DIR", help="build without the patches and install into DIR (pip --target), "
                    "not into this Python: the unpatched runtime that tests compare against")
    args = ap.parse_args(argv)

    cmake_args = ["-DGGML_NATIVE=ON" if args.native else "-DGGML_NATIVE=OFF", *BASE_CMAKE]
    if args.cuda:
        cmake_args.append("-DGGML_CUDA=on")
    cmake_args += os.environ.get("CMAKE_ARGS", "").split() + args.cmake_args.split()

    cache = cache_dir()
    stock = args.stock is not None
    wheel_dir = cache / "wheels" / (("stock-" if stock else "") + build_key(cmake_args, stock))
    wheels = list(wheel_dir.glob("llama_cpp_python-*.whl"))
    if wheels and not args.rebuild:
        step(f"using the cached build {wheels[0]}")
        wheel = wheels[0]
    else:
        shutil.rmtree(wheel_dir, ignore_errors=True)
        wheel = build_wheel(fetch_sdist(cache / "src"), cmake_args, wheel_dir, args.jobs, stock)
    if stock:
        step(f"installing the unpatched build into {args.stock}")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--upgrade", "--target", args.stock, str(wheel)]
        if subprocess.run(cmd).returncode:
            fail(f"pip could not install the unpatched wheel into {args.stock}")
        return 0
    step("installing")
    cmd = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", "-q", str(wheel)]
    deps = [sys.executable, "-m", "pip", "install", "-q", "numpy>=1.20", "typing-extensions>=4.5", "diskcache>=5.6.1", "jinja2>=2.11.3"]
    if subprocess.run(deps).returncode or subprocess.run(cmd).returncode:
        fail("pip could not install the built wheel")
    step(f"done: {PACKAGE} {VERSION} with {len(patches())} kvlocal patches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
