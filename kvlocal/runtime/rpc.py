"""llama.cpp's RPC backend: some of a model's layers, and their KV cache, on `rpc-server`s of other machines.

A graph travels to an rpc-server as ops with their sources and runs on its ggml backend, so kvlocal's on-device
operations (compaction, scores, row copies, merges: compositions of ordinary ggml ops) run where the cache lives;
only what the engine would move between the host and a GPU crosses the network. This module is the runtime's
face of that backend:

- :func:`parse_endpoints`: ``HOST:PORT[,HOST:PORT…]`` (llama.cpp's ``--rpc`` syntax), refused in one line;
- :func:`probe`: a server's RPC protocol version, devices and memory, read over a socket of our own with a
  timeout — ggml-rpc aborts the whole process when a server cannot be reached or speaks another protocol, so every
  endpoint is asked here first and a refusal is one line naming the server;
- :func:`remote_devices`: the ggml devices of the servers (``ggml_backend_rpc_add_server`` through the RPC
  registry's proc address), for ``llama_model_params.devices``; they are not added to ggml's global registry, so
  a model loaded later without ``rpc=`` stays local;
- :func:`check_lost`: a server that stops mid-computation (or breaks the protocol) no longer aborts the process
  (patch 0015): its connection is marked lost, every later operation on its devices fails, and the runtime asks
  after each of its calls, raising :class:`~kvlocal.errors.ServerLost` naming the server. A model loaded again
  once the server is back connects afresh (``kvlocal serve`` does so by itself);
- :func:`guard_aborts`: what ggml-rpc still aborts on (a connection or handshake that fails while a model loads)
  becomes one line naming the server, instead of a core dump with a C backtrace;
- :func:`server_binary`: the ``ggml-rpc-server`` built beside the libraries kvlocal loaded (the same patched tree).

What the protocol does not say: which ggml a server runs. Its HELLO carries only the protocol version, which the
patch series does not change (it adds no op: the attention bias is an extra source of ``FLASH_ATTN_EXT``), and
``supports_op`` is answered by the client without asking. A stock server would compute flash attention without the
bias. :func:`check_bias` therefore runs one ``FLASH_ATTN_EXT`` with a bias on each server, over the same socket,
and refuses a server whose result ignores it.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from kvlocal.errors import ServerLost, UsageError
import kvlocal.runtime.library as library

# RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of the pinned llama.cpp (ggml/include/ggml-rpc.h): the client refuses a
# server of another major version or a newer minor one by aborting, so kvlocal asks first
PROTOCOL = (7, 0, 0)
DEFAULT_PORT = 50052  # rpc-server's default
SERVER_NAMES = ("ggml-rpc-server", "rpc-server")  # this llama.cpp's name, then the older one
TIMEOUT = 5.0  # seconds a probe waits for a server: to connect, and for each answer
SECURITY = ("llama.cpp's RPC server is a proof of concept and insecure: anyone who reaches its port can run graphs "
            "and read or write its memory; never expose it to an open network or run it in a sensitive environment")
SERVER_HINT = "start `kvlocal rpc-server` there (the same kvlocal build)"

# ggml-rpc's commands (enum rpc_cmd)
CMD_ALLOC_BUFFER, CMD_BUFFER_GET_BASE, CMD_FREE_BUFFER = 0, 3, 4
CMD_SET_TENSOR, CMD_GET_TENSOR, CMD_GRAPH_COMPUTE, CMD_GET_DEVICE_MEMORY = 6, 8, 10, 11
CMD_HELLO, CMD_DEVICE_COUNT = 14, 15
CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: all zero, no RDMA offered


def parse_endpoints(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT…]`` (a string or strings) as a tuple of ``host:port``; UsageError naming the bad one."""
    if not spec:
        return ()
    parts = [p.strip() for s in ([spec] if isinstance(spec, str) else spec) for p in str(s).split(",")]
    out = []
    for p in parts:
        host, sep, port = p.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--rpc {p!r}: give HOST:PORT[,HOST:PORT…], e.g. 192.168.1.20:{DEFAULT_PORT}")
        out.append(f"{host.strip('[]')}:{int(port)}")
    if len(set(out)) != len(out):
        raise UsageError(f"--rpc {','.join(out)}: a server is named twice")
    return tuple(out)


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


@dataclass(frozen=True)
class ServerInfo:
    """What an rpc-server says of itself: its protocol version and each device's (free, total) bytes."""

    endpoint: str
    protocol: tuple[int, int, int]
    memory: tuple[tuple[int, int], ...]

    def describe(self) -> list[str]:
        v = ".".join(map(str, self.protocol))
        return [f"{self.endpoint} device {i}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free (RPC protocol {v})"
                for i, (free, total) in enumerate(self.memory)]


class Connection:
    """One client connection to an rpc-server, spoken in Python with a timeout on every read (ggml-rpc's client
    has none). The server serves one client at a time: close it before llama.cpp connects."""

    def __init__(self, endpoint: str, timeout: float = TIMEOUT):
        self.endpoint = endpoint
        try:
            self.sock = socket.create_connection(split(endpoint), timeout=timeout)
        except OSError as e:
            raise UsageError(f"rpc-server {endpoint} cannot be reached ({e.strerror or e}): {SERVER_HINT}, "
                             f"or check the address and the firewall") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, cmd: int, payload: bytes = b"") -> None:
        """A request without an answer: | cmd (1 byte) | size (8 bytes) | payload |."""
        try:
            self.sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
        except OSError as e:
            self._closed(e)

    def _closed(self, e: OSError | None = None) -> None:
        raise UsageError(f"rpc-server {self.endpoint} closed the connection{f' ({e.strerror or e})' if e else ''}: it "
                         f"may be of another llama.cpp version, or busy with another client; {SERVER_HINT}") from None

    def call(self, cmd: int, payload: bytes = b"") -> bytes:
        """A request and its answer: | size (8 bytes) | answer |."""
        self.send(cmd, payload)
        (n,) = struct.unpack("<Q", self._recv(8))
        return self._recv(n)

    def _recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                got = self.sock.recv(n - len(out))
            except socket.timeout:
                raise UsageError(f"rpc-server {self.endpoint} does not answer: it serves one client at a time and "
                                 f"may be busy with another; stop that client or start another server") from None
            except OSError as e:
                self._closed(e)
            if not got:
                self._closed()
            out += got
        return bytes(out)

    def hello(self) -> tuple[int, int, int]:
        """The server's RPC protocol version (the first command of every connection)."""
        major, minor, patch, _ = struct.unpack_from("<4B", self.call(CMD_HELLO, bytes(CONN_CAPS)))
        return major, minor, patch

    def memory(self) -> tuple[tuple[int, int], ...]:
        """(free, total) bytes of each of the server's devices."""
        (n,) = struct.unpack("<I", self.call(CMD_DEVICE_COUNT))
        return tuple(struct.unpack("<QQ", self.call(CMD_GET_DEVICE_MEMORY, struct.pack("<I", i))) for i in range(n))


def probe(endpoint: str, timeout: float = TIMEOUT) -> ServerInfo:
    """Ask a server its protocol version and devices; UsageError, in one line naming it, if it cannot be reached,
    does not answer within ``timeout`` or speaks another protocol than this llama.cpp."""
    with Connection(endpoint, timeout) as c:
        version = c.hello()
        check_protocol(endpoint, version)
        return ServerInfo(endpoint, version, c.memory())


def check_protocol(endpoint: str, version: tuple[int, int, int]) -> None:
    """The client's rule (ggml-rpc's ``negotiate_hello``): the same major version and a minor one no newer."""
    if version[0] != PROTOCOL[0] or version[1] > PROTOCOL[1]:
        v, mine = ".".join(map(str, version)), ".".join(map(str, PROTOCOL))
        raise UsageError(f"rpc-server {endpoint} speaks RPC protocol {v}, this kvlocal's llama.cpp speaks {mine}: "
                         f"{SERVER_HINT}")


# -- does the server's ggml know the attention bias? ----------------------------------------------------------------
class RpcTensor(ctypes.Structure):
    """``struct rpc_tensor`` of ggml-rpc (packed, as all its messages: 296 bytes; GGML_MAX_DIMS 4,
    GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _pack_ = 1
    _fields_ = [("id", ctypes.c_uint64), ("type", ctypes.c_uint32), ("buffer", ctypes.c_uint64),
                ("ne", ctypes.c_uint32 * 4), ("nb", ctypes.c_uint32 * 4), ("op", ctypes.c_uint32),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32), ("src", ctypes.c_uint64 * 10),
                ("view_src", ctypes.c_uint64), ("view_offs", ctypes.c_uint64), ("data", ctypes.c_uint64),
                ("name", ctypes.c_char * 64), ("use_count", ctypes.c_int32)]


assert ctypes.sizeof(RpcTensor) == 296
GGML_F32, GGML_F16, OP_FLASH_ATTN_EXT = 0, 1, 74  # this llama.cpp's ggml_type and ggml_op values
FLAG_COMPUTE = 16  # GGML_TENSOR_FLAG_COMPUTE: a graph node the backend computes
BIAS_SRC = 5  # kvlocal's patch 0003: ggml_flash_attn_ext_add_bias sets src[5]


def _tensor(tid: int, buffer: int, data: int, type_: int, ne: tuple[int, ...], op: int = 0, src=(),
            op_params=()) -> RpcTensor:
    t = RpcTensor(id=tid, type=type_, buffer=buffer, data=data, op=op, use_count=1)
    size = 4 if type_ == GGML_F32 else 2
    nb = [size]
    for n in ne[:-1]:
        nb.append(nb[-1] * n)
    t.ne[:], t.nb[:] = list(ne), nb
    for i, s in src:
        t.src[i] = s
    for i, p in enumerate(op_params):
        t.op_params[i] = p
    return t


def check_bias(endpoint: str, timeout: float = TIMEOUT) -> None:
    """Refuse a server whose ggml computes flash attention without kvlocal's attention bias (a stock build).

    One ``FLASH_ATTN_EXT`` over two cells of equal keys, values +1 and -1 and a bias of +2 and -2, computed on the
    server's device 0: the patched kernel gives tanh(2) ≈ 0.964 in every dimension, a stock one the unbiased mean, 0.
    A few hundred bytes cross; the server frees its buffer when the connection closes."""
    import numpy as np

    d, n_kv = 32, 2
    q = np.zeros(d, np.float32)
    k = np.zeros((n_kv, d), np.float16)
    v = np.stack([np.ones(d), -np.ones(d)]).astype(np.float16)
    bias = np.array([2.0, -2.0], np.float32)
    parts = [q.tobytes(), k.tobytes(), v.tobytes(), bias.tobytes(), np.full(d, 7.0, np.float32).tobytes()]
    offs = [256 * i for i in range(len(parts))]
    with Connection(endpoint, timeout) as c:
        version = c.hello()
        check_protocol(endpoint, version)
        remote, size = struct.unpack("<QQ", c.call(CMD_ALLOC_BUFFER, struct.pack("<IQ", 0, offs[-1] + 256)))
        if not remote or size < offs[-1] + 4 * d:
            raise UsageError(f"rpc-server {endpoint} could not allocate a probe buffer of {offs[-1] + 256} bytes")
        (base,) = struct.unpack("<Q", c.call(CMD_BUFFER_GET_BASE, struct.pack("<Q", remote)))
        tq = _tensor(1, remote, base + offs[0], GGML_F32, (d, 1, 1, 1))
        tk = _tensor(2, remote, base + offs[1], GGML_F16, (d, n_kv, 1, 1))
        tv = _tensor(3, remote, base + offs[2], GGML_F16, (d, n_kv, 1, 1))
        tb = _tensor(4, remote, base + offs[3], GGML_F32, (n_kv, 1, 1, 1))
        scale = struct.unpack("<i", struct.pack("<f", 1.0))[0]
        out = _tensor(5, remote, base + offs[4], GGML_F32, (d, 1, 1, 1), OP_FLASH_ATTN_EXT,
                      [(0, 1), (1, 2), (2, 3), (BIAS_SRC, 4)], [scale, 0, 0, 0])
        out.flags = FLAG_COMPUTE
        for t, data in zip((tq, tk, tv, tb, out), parts):  # the result's memory too: 7 where nothing is written
            c.send(CMD_SET_TENSOR, bytes(t) + struct.pack("<BQ", 0, 0) + data)
        tensors = (tq, tk, tv, tb, out)
        c.send(CMD_GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, out.id, len(tensors)) + b"".join(map(bytes, tensors)))
        got = np.frombuffer(c.call(CMD_GET_TENSOR, bytes(out) + struct.pack("<QQ", 0, 4 * d)), np.float32)
        c.send(CMD_FREE_BUFFER, struct.pack("<Q", remote))
    if np.allclose(got, np.tanh(2.0), atol=1e-2):
        return
    from kvlocal.runtime.library import REQUIRED_PATCH_ABI

    what = "a stock ggml (its flash attention ignores the attention bias)" if np.allclose(got, 0, atol=1e-2) else \
        f"a ggml whose biased flash attention gives {float(got.mean()):.3f}, not {np.tanh(2.0):.3f}"
    raise UsageError(f"rpc-server {endpoint} runs RPC protocol {'.'.join(map(str, version))} with {what}; this "
                     f"kvlocal needs RPC protocol {'.'.join(map(str, PROTOCOL))} with kvlocal's patched ggml (patch ABI "
                     f"{REQUIRED_PATCH_ABI}): {SERVER_HINT}")


# -- the devices -----------------------------------------------------------------------------------------------------
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_checked: dict[str, ServerInfo] = {}  # endpoints probed (and checked) by this process


def _ggml(name: str, restype, argtypes):
    """A ggml function of the loaded runtime (libllama's dependencies: the same build as libllama)."""
    from kvlocal.runtime.library import llama_lib

    fn = getattr(llama_lib()._lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def has_rpc() -> bool:
    """Whether the runtime was built with ggml's RPC backend (``GGML_RPC=ON``)."""
    return bool(_ggml("ggml_backend_reg_by_name", ctypes.c_void_p, [ctypes.c_char_p])(b"RPC"))


def remote_devices(endpoints: Sequence[str], timeout: float = TIMEOUT) -> list[int]:
    """The ggml devices (handles) of the servers, server after server, each server probed and checked first."""
    if not endpoints:
        return []
    if not has_rpc():
        raise UsageError("--rpc: this llama.cpp was built without the RPC backend: rerun `python ggml_patches/build.py` "
                         "(it builds GGML_RPC=ON)")
    reg = _ggml("ggml_backend_reg_by_name", ctypes.c_void_p, [ctypes.c_char_p])(b"RPC")
    proc = _ggml("ggml_backend_reg_get_proc_address", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p])
    add_server = _ADD_SERVER(proc(reg, b"ggml_backend_rpc_add_server"))
    count = _ggml("ggml_backend_reg_dev_count", ctypes.c_size_t, [ctypes.c_void_p])
    get = _ggml("ggml_backend_reg_dev_get", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t])
    devices = []
    for ep in endpoints:
        if ep not in _checked:
            info = probe(ep, timeout)
            check_bias(ep, timeout)
            _checked[ep] = info
        server = add_server(ep.encode())
        if not server:
            raise UsageError(f"rpc-server {ep} has no device: start it with `kvlocal rpc-server --device …`")
        devices += [get(server, i) for i in range(count(server))]
    guard_aborts(endpoints)
    library.quiet_errors = lambda: bool(lost(_guarded))
    return devices


def local_gpus() -> list[int]:
    """This machine's GPU devices, as llama.cpp picks them by default (discrete ones, else integrated ones)."""
    n = _ggml("ggml_backend_dev_count", ctypes.c_size_t, [])()
    get = _ggml("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t])
    kind = _ggml("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p])
    devs = [get(i) for i in range(n)]
    gpus = [d for d in devs if kind(d) == 1]  # GGML_BACKEND_DEVICE_TYPE_GPU (RPC devices are never registered here)
    return gpus or [d for d in devs if kind(d) == 2][:1]  # _IGPU


def device_name(dev: int) -> str:
    name = _ggml("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p])(dev).decode()
    desc = _ggml("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p])(dev).decode()
    return f"{name} ({desc})"


# -- a dead server ---------------------------------------------------------------------------------------------------
_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_guarded: list[str] = []
_abort_cb = None  # kept alive while installed


_LOST = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_char_p)
_lost_fn = None


def lost(endpoints: Sequence[str]) -> list[str]:
    """The endpoints whose connection this process lost (ggml-rpc's ``ggml_backend_rpc_lost``, patch 0015): the
    server stopped or broke the protocol, and every operation on its devices since has done nothing."""
    global _lost_fn
    if not endpoints:
        return []
    if _lost_fn is None:
        reg = _ggml("ggml_backend_reg_by_name", ctypes.c_void_p, [ctypes.c_char_p])(b"RPC")
        proc = _ggml("ggml_backend_reg_get_proc_address", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p])
        ptr = proc(reg, b"ggml_backend_rpc_lost")
        _lost_fn = _LOST(ptr) if ptr else (lambda endpoint: False)  # a runtime without 0015 aborts instead
    return [ep for ep in endpoints if _lost_fn(ep.encode())]


AFTER_LOSS = "restart it (`kvlocal rpc-server`) and load the chat's last save, or run without it"


def lost_text(endpoints: Sequence[str], stopped: bool, why: str = "", then: str = AFTER_LOSS) -> str:
    """What kvlocal says of servers lost mid-computation: which, whether they ``stopped`` (refuse connections) or
    failed (answer, but broke the protocol), and what to do."""
    return (f"rpc-server {', '.join(endpoints)} {'stopped' if stopped else 'failed'} mid-computation"
            f"{f' ({why})' if why else ''}: the layers it held and their KV cache are lost; {then}")


def check_lost(endpoints: Sequence[str]) -> None:
    """Raise :class:`~kvlocal.errors.ServerLost` if this process lost the connection to one of ``endpoints``."""
    if endpoints and (gone := lost(endpoints)):
        for ep in gone:  # probed and checked again when a model is loaded again
            _checked.pop(ep, None)
        stopped = bool(dead_servers(gone, wait=1.0))
        raise ServerLost(gone, lost_text(gone, stopped), stopped)


def dead_servers(endpoints: Sequence[str], timeout: float = 0.5, wait: float = 0.0) -> list[str]:
    """The endpoints that refuse a connection now (a server that died; a live one accepts, even while busy). A
    dying server's connection may close a moment before its listening socket does: with ``wait``, the servers are
    asked again for up to that many seconds while none refuses."""
    end = time.monotonic() + wait
    while True:
        dead = []
        for ep in endpoints:
            try:
                socket.create_connection(split(ep), timeout=timeout).close()
            except OSError:
                dead.append(ep)
        if dead or time.monotonic() >= end:
            return dead
        time.sleep(0.1)


def abort_line(message: str, endpoints: Sequence[str], wait: float = 2.0) -> str | None:
    """The line kvlocal prints when ggml aborts: a lost server named, with what to do; None for an abort that is
    not the RPC backend's (ggml then aborts as it would)."""
    dead = dead_servers(endpoints, wait=wait if "RPC" in message else 0)
    if not dead and "RPC" not in message:
        return None
    message = re.sub(r"^\S+:\d+: ", "", message.strip())  # ggml's source file and line
    return f"kvlocal: error: {lost_text(dead or endpoints, bool(dead), 'llama.cpp: ' + message.strip())}"


def guard_aborts(endpoints: Sequence[str]) -> None:
    """Install (once) ggml's abort callback: an abort caused by a server (a connection or handshake that fails as
    a model loads: ggml-rpc aborts there) prints :func:`abort_line` and exits the process with status 1."""
    global _abort_cb
    _guarded.extend(ep for ep in endpoints if ep not in _guarded)
    if _abort_cb is not None:
        return

    def on_abort(message: bytes) -> None:
        line = abort_line((message or b"").decode(errors="replace"), list(_guarded))
        if line is None:  # not the RPC backend's: ggml's own message (it prints none while a callback is set)
            os.write(2, (message or b"ggml aborted") + b"\n")
            return
        os.write(2, (line + "\n").encode())
        os._exit(1)

    _abort_cb = _ABORT_CB(on_abort)
    _ggml("ggml_set_abort_callback", ctypes.c_void_p, [_ABORT_CB])(_abort_cb)


# -- the server ------------------------------------------------------------------------------------------------------
def server_binary() -> Path | None:
    """llama.cpp's rpc-server built beside the libllama kvlocal loaded (``ggml_patches/build.py`` installs it into
    the wheel's ``llama_cpp/lib``): the same patched tree and ABI. None if that build has none."""
    from kvlocal.runtime.library import runtime_info

    lib_dir = Path(runtime_info().library).resolve().parent
    for name in SERVER_NAMES:
        path = lib_dir / (name + (".exe" if sys.platform == "win32" else ""))
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None
