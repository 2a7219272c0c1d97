"""``kvlocal rpc-server`` and ``kvlocal doctor --rpc``: llama.cpp's RPC server from kvlocal's own build, and what
the servers a main host would use say of themselves (docs/distributed.md)."""

from __future__ import annotations

import os
import sys

from kvlocal.errors import UsageError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(p) -> None:
    from kvlocal.runtime import DEFAULT_PORT, SECURITY

    p.description = (f"Serve this machine's devices (CPU, GPUs) to a kvlocal on another machine: `kvlocal chat --rpc "
                     f"THIS_HOST:PORT` there puts layers and their KV cache here. It runs llama.cpp's ggml-rpc-server "
                     f"built with kvlocal's patches (ggml_patches/build.py). WARNING: {SECURITY}. Bind it to a private "
                     f"network's address only (--host), or keep the default 127.0.0.1 and tunnel to it (ssh -L).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                   "0.0.0.0 or a LAN address exposes it, see the warning above)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--device", default=None, help="comma-separated ggml devices to serve (default: all; e.g. CUDA0, CPU)")
    p.add_argument("--threads", type=int, default=None, help="threads of the CPU device (default: half the cores)")


def server_command(args) -> list[str]:
    """The rpc-server command line: the binary built beside kvlocal's libraries, with the options given."""
    from kvlocal.runtime import server_binary

    binary = server_binary()
    if binary is None:
        raise UsageError("this llama.cpp runtime has no rpc-server beside its libraries: rerun "
                         "`python ggml_patches/build.py` (it builds GGML_RPC=ON and the server)")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: give a TCP port, 1-65535")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: give 1 or more")
    cmd = [str(binary), "--host", args.host, "--port", str(args.port)]
    if args.device:
        cmd += ["--device", args.device]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def run(args) -> int:
    from kvlocal.runtime import SECURITY

    cmd = server_command(args)
    if args.host not in LOOPBACK:
        print(f"kvlocal: WARNING: listening on {args.host}: {SECURITY}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(cmd[0], cmd)  # the server is this process: a signal to kvlocal's pid stops it
    except OSError as e:
        raise UsageError(f"cannot run {cmd[0]} ({e.strerror}): rerun `python ggml_patches/build.py`") from None


def doctor_rows(spec: str) -> tuple[list[tuple[str, str]], int]:
    """``kvlocal doctor --rpc``'s rows: each server's devices and memory and whether it runs kvlocal's patched ggml;
    (rows, problems)."""
    from kvlocal.runtime import check_bias, has_rpc, parse_endpoints, probe

    rows, problems = [], 0
    try:
        has = has_rpc()
    except UsageError as e:
        return [("rpc", f"NOT AVAILABLE: {e}")], 1
    if not has:
        return [("rpc", "this llama.cpp has no RPC backend: rerun `python ggml_patches/build.py`")], 1
    for ep in parse_endpoints(spec):
        try:
            info = probe(ep)
            check_bias(ep)
            rows += [("rpc", line) for line in info.describe()]
            rows.append(("", f"{ep}: kvlocal's patched ggml (flash attention adds the attention bias)"))
        except UsageError as e:
            rows.append(("rpc", f"PROBLEM: {e}"))
            problems += 1
    return rows, problems


def runtime_row() -> tuple[str, str]:
    """``kvlocal doctor``'s rpc row: whether the runtime has the RPC backend and where its server is."""
    from kvlocal.runtime import has_rpc, server_binary

    if not has_rpc():
        return ("rpc", "not built: --rpc needs `python ggml_patches/build.py` (GGML_RPC=ON)")
    binary = server_binary()
    return ("rpc", f"RPC backend built; `kvlocal rpc-server` runs {binary}" if binary else
            "RPC backend built, but no rpc-server beside the libraries: rerun `python ggml_patches/build.py`")
