#!/usr/bin/env python3
"""Check that the patch series bisects: apply patches 1..k to the pinned llama.cpp and build its CPU libraries, for
every k (or the ones given).

    python ggml_patches/check_series.py              # every prefix, one tree built incrementally (~2-4 min a patch)
    python ggml_patches/check_series.py 11 12 22     # only these prefixes (each still applies 1..k)
    python ggml_patches/check_series.py --work DIR   # keep the tree and its build in DIR

A patch that does not apply, or a prefix whose `llama` target does not compile, ends the run with its number and the
compiler's last lines (exit 1). The tree is the source package build.py verifies (its sha256), so what is checked is
what build.py builds. Needs git, CMake and a C++ compiler (as build.py).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import build

CMAKE = ["-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DCMAKE_BUILD_TYPE=Release"]
GIT = ["git", "-c", "user.email=kvlocal@localhost", "-c", "user.name=kvlocal"]


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def base_tree(work: Path) -> Path:
    """The pinned llama.cpp, unpatched, as a git tree (one commit) in ``work``."""
    with tarfile.open(build.fetch_sdist(build.cache_dir() / "src")) as t:
        t.extractall(work, filter="data")
    src = next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    shutil.rmtree(src / ".git", ignore_errors=True)
    (src / ".git").unlink(missing_ok=True)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*GIT, "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=src, check=True, capture_output=True)
    return src


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefixes", nargs="*", type=int, help="the k to build (default: every one)")
    ap.add_argument("--work", type=Path, help="a folder for the tree and its build (default: a temporary one)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    series = build.patches()
    wanted = sorted(set(args.prefixes or range(1, len(series) + 1)))
    if any(k < 1 or k > len(series) for k in wanted):
        sys.exit(f"check_series.py: give prefixes between 1 and {len(series)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="kvlocal-series-"))
    work.mkdir(parents=True, exist_ok=True)
    src = base_tree(work)
    if (r := run(["cmake", "-S", ".", "-B", "build", *CMAKE], src)).returncode:
        sys.exit(f"check_series.py: CMake failed:\n{r.stderr[-2000:]}")
    for k, patch in enumerate(series, 1):
        if k > wanted[-1]:
            break
        if (r := run([*GIT, "am", "-q", str(patch)], src)).returncode:
            print(f"{k:3d} {patch.name}: does not apply\n{r.stderr[-2000:]}")
            return 1
        if k not in wanted:
            continue
        t0 = time.perf_counter()
        r = run(["cmake", "--build", "build", "--target", "llama", "-j", str(args.jobs)], src)
        status = "builds" if r.returncode == 0 else "does not build"
        print(f"{k:3d} {patch.name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if r.returncode:
            print((r.stdout + r.stderr)[-3000:])
            return 1
    print(f"every prefix of {', '.join(map(str, wanted))} applies and builds ({work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
