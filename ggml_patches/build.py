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
Python. The wheel carries a record of the build (llama_cpp/kvlocal_build.json: the patches applied, those
left out and why) that `kvlocal doctor` and the runtime read.

On macOS llama-cpp-python's own build switches Metal on and embeds ggml-metal's kernels as source, which the
library compiles when it loads: there the wheel is also loaded once in a fresh Python. If ggml-metal fails to
compile — at the build or at that load — with the patch series' Metal kernels (the patches that change only
ggml-metal: flash attention with the attention bias), the wheel is built again without them and the record says
so; kvlocal then keeps caches that carry a bias on the soft-max attention path on Metal, which adds the bias.

The wheel is kept in the kvlocal cache under a key made of the source hash, the patches and the
CMake flags, so a second run with the same inputs installs in seconds. --rebuild ignores it.

Why GGML_NATIVE=OFF by default: on some virtual machines the CPU advertises AMX but a -march=native
build segfaults at the first decode inside ggml's AMX code; a portable build avoids it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# what the build leaves out: multimodal (llava/mtmd), tests, examples, tools, server; what it adds: ggml's RPC
# backend (layers and their KV cache on other machines' rpc-servers, docs/distributed.md)
BASE_CMAKE = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_RPC=ON"]
# llama.cpp's rpc-server, built against the wheel's own ggml and installed beside its libraries (llama_cpp/lib,
# RPATH $ORIGIN), where `kvlocal rpc-server` finds it: the tools are off (each would be built), so its directory is
# added alone, after llama-cpp-python's CMakeLists has defined the install function
RPC_SERVER_CMAKE = """
# [kvlocal] llama.cpp's rpc-server from this tree, beside the libraries it links (ggml_patches/build.py)
if (LLAMA_BUILD AND GGML_RPC AND NOT EMSCRIPTEN AND NOT TARGET ggml-rpc-server)
    add_subdirectory(vendor/llama.cpp/tools/rpc ${CMAKE_BINARY_DIR}/kvlocal-rpc-server)
    llama_cpp_python_install_target(ggml-rpc-server)
endif()
"""

HERE = Path(__file__).resolve().parent
RECORD = "kvlocal_build.json"  # in llama-cpp-python's package, beside lib/ (kvlocal.runtime.buildinfo reads it)
# llama-cpp-python's CMakeLists forces GGML_METAL on for every Apple build
METAL = sys.platform == "darwin"
# a line where ggml-metal reports an error: the compiler's, the build tool's (FAILED, Error 1) or the library's
# own when it compiles its kernels at load ("ggml_metal_library_compile_all: error compiling source")
METAL_NAME, ERROR = re.compile(r"ggml[-_]metal", re.I), re.compile(r"\berror\b|\bFAILED\b", re.I)
# registers ggml's backends, as kvlocal does at startup: ggml-metal compiles its kernels there
LOAD_PROBE = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.llama_print_system_info.restype = ctypes.c_char_p; "
              "print(lib.llama_print_system_info().decode())")


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
    h.update(RPC_SERVER_CMAKE.encode())
    return h.hexdigest()[:16]


def metal_only(patch: Path) -> bool:
    """Whether a patch changes only ggml's Metal backend: the part of the series a Mac build may leave out (the
    soft-max attention path carries the attention bias without it)."""
    files = re.findall(r"^diff --git a/(\S+) ", patch.read_text(), re.M)
    return bool(files) and all(f.startswith("ggml/src/ggml-metal/") for f in files)


def metal_failure(log: str) -> str | None:
    """The first line of a build's or a load's output where ggml-metal reports an error, else None."""
    return next((line.strip()[:300] for line in log.splitlines() if METAL_NAME.search(line) and ERROR.search(line)), None)


def add_rpc_server(tree: Path) -> None:
    """Have llama-cpp-python's build make llama.cpp's rpc-server too (only with GGML_RPC on)."""
    with open(tree / "CMakeLists.txt", "a") as f:
        f.write(RPC_SERVER_CMAKE)


def write_record(tree: Path, series: list[Path], left_out: dict[str, str]) -> None:
    """The build's record in llama-cpp-python's package: the patches applied, the series' Metal-only ones and those
    left out, each with the line that made build.py leave it out."""
    record = {"patches": [p.name for p in series if p.name not in left_out],
              "metal_patches": [p.name for p in series if metal_only(p)], "left_out": left_out}
    (tree / "llama_cpp" / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def wheel_record(wheel: Path) -> dict | None:
    """The record a wheel carries (None: a wheel built before build.py wrote one)."""
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read(f"llama_cpp/{RECORD}")) if f"llama_cpp/{RECORD}" in z.namelist() else None


def apply_patches(tree: Path, series: list[Path]) -> None:
    llama = tree / "vendor" / "llama.cpp"
    (llama / ".git").unlink(missing_ok=True)  # a submodule pointer that git apply would trip over
    for p in series:
        step(f"applying {p.name}")
        if shutil.which("patch"):
            cmd, cwd = ["patch", "-p1", "--forward", "--batch", "-i", str(p)], llama
        else:  # the source package carries a .git of its own: apply from its root
            cmd, cwd = ["git", "apply", "-p1", "--directory=vendor/llama.cpp", str(p)], tree
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{p.name} does not apply to the vendored llama.cpp:\n{r.stdout}{r.stderr}")


def tee(cmd: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd`` with its output on the terminal as it comes and kept: (exit code, output)."""
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as p:
        for line in p.stdout:
            sys.stdout.write(line)
            lines.append(line)
    return p.returncode, "".join(lines)


def load_wheel(wheel: Path) -> tuple[int, str]:
    """Load the wheel's libllama in a fresh Python and register ggml's backends, as kvlocal does when it starts:
    (exit code, output). ggml-metal compiles its embedded kernel sources there, not when the wheel is built."""
    with tempfile.TemporaryDirectory(prefix="kvlocal-load-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("llama_cpp/lib/")])
        lib = Path(tmp) / "llama_cpp" / "lib" / ("libllama.dylib" if sys.platform == "darwin" else "libllama.so")
        r = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(lib)], capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def compile_wheel(tree: Path, env: dict, out: Path, metal: bool) -> str | None:
    """``pip wheel`` of the patched tree into ``out``, and on a Metal build the wheel loaded once: None when both
    work, else the output that tells why not (empty where it went to the terminal only: a build without Metal)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(tree)]
    if not metal:
        return None if subprocess.run(cmd, env=env).returncode == 0 else ""
    rc, log = tee(cmd, env)
    if rc != 0:
        return log
    step("loading the wheel once: ggml-metal compiles its kernels")
    rc, log = load_wheel(next(out.glob("llama_cpp_python-*.whl")))
    print(log, end="")
    if rc != 0:  # a crash while ggml-metal loads its kernels (an assert, a null library) is ggml-metal's failure too
        return f"{log}\nggml-metal: error: loading the wheel ended with exit code {rc}\n"
    return None if metal_failure(log) is None else log


Compile = Callable[[Path, dict, Path, bool], "str | None"]  # (tree, env, out, metal) -> None or why not


def build_wheel(sdist: Path, cmake_args: list[str], out: Path, jobs: int, stock: bool = False,
                compile_tree: Compile = compile_wheel, metal: bool = METAL) -> Path:
    """Build the wheel into ``out`` with the whole series (none with ``stock``); on a Metal build whose ggml-metal
    fails with the series' Metal-only patches, once more without them. ``compile_tree`` builds one tree (tests stand
    in a failing one for the real build)."""
    series = [] if stock else patches()
    left_out: dict[str, str] = {}
    while (log := build_once(sdist, series, left_out, cmake_args, out, jobs, compile_tree, metal)) is not None:
        shutil.rmtree(out, ignore_errors=True)
        optional = [p.name for p in series if metal_only(p) and p.name not in left_out]
        why = metal_failure(log) if metal else None
        if why and not optional:
            fail(f"ggml-metal failed ({why}) without kvlocal's Metal patches too: see the output above")
        if not why:
            fail("the llama.cpp build failed (see the compiler output above); a C/C++ compiler and CMake are needed")
        step(f"ggml-metal failed with {', '.join(optional)} ({why}): building again without "
             f"{'it' if len(optional) == 1 else 'them'}; biased caches keep to the soft-max attention path on Metal")
        left_out.update(dict.fromkeys(optional, why))
    wheels = list(out.glob("llama_cpp_python-*.whl"))
    if not wheels:
        fail("the build produced no wheel")
    return wheels[0]


def build_once(sdist: Path, series: list[Path], left_out: dict[str, str], cmake_args: list[str], out: Path, jobs: int,
               compile_tree: Compile, metal: bool) -> str | None:
    """One build of the series less ``left_out`` into ``out``: None when it worked, else the output of its failure."""
    with tempfile.TemporaryDirectory(prefix="kvlocal-build-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        tree = Path(tmp) / f"llama_cpp_python-{VERSION}"
        apply_patches(tree, [p for p in series if p.name not in left_out])
        add_rpc_server(tree)
        write_record(tree, series, left_out)
        env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args), CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
        step(f"compiling llama.cpp ({' '.join(cmake_args)}); this takes several minutes")
        out.mkdir(parents=True, exist_ok=True)
        return compile_tree(tree, env, out, metal)


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
    left_out = (wheel_record(wheel) or {}).get("left_out", {})
    step(f"done: {PACKAGE} {VERSION} with {len(patches()) - len(left_out)} kvlocal patches"
         + "".join(f"; {name} left out ({why})" for name, why in left_out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
