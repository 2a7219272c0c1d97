"""Capturing post-RoPE queries from llama.cpp's graph through the eval callback.

The scoring step of a compression event needs the queries of an observation window (the last tokens
decoded) in every layer. llama.cpp names the query after RoPE ``Qcur-<layer>``; the same name is also
given to the projection (MUL_MAT), the bias add (ADD, qwen2) and the reshape (RESHAPE) before it, so
the node is picked by name *and* op (ROPE). Its data is f32 ``[head_dim, n_head, n_tokens]`` (ggml
order, innermost first); only the rows of the last tokens are copied.

How the scheduler calls the callback (ggml-backend.cpp, ``ggml_backend_sched_compute_splits``): for
every node, first with ``ask=True`` ("do you want this one?"); for each node answered True it computes
the graph up to that node, synchronises the backend and calls again with ``ask=False`` and the data
ready. Each True answer splits the graph (on a GPU: a sync and a copy), so the ask phase answers True
only while armed and only for the ROPE ``Qcur-N`` nodes. In the data phase, returning False stops the
rest of that graph split (garbage logits, no error): this callback always returns True there, and an
exception raised while copying is kept and raised again by :meth:`QueryCapture.take`.

The captured q is the model's query: with a quantized K cache, llama.cpp rotates q and K by a
Walsh–Hadamard matrix inside attention, after this node, so dot products with K rows read from such a
cache need ``H·q``. Flash attention does not change this node.

Cost: once a callback is installed, the scheduler calls it (through Python) for every node of every
graph, armed or not — about 1,100 ask calls per SmolLM2 graph.

Usage::

    cap = QueryCapture.for_model(model)
    ctx = Context(model, n_ctx, cb_eval=cap.callback)
    ctx.decode(chunk)                # disarmed: nothing is copied
    cap.arm(32)
    ctx.decode(window)               # may be split into several batches / ubatches
    queries = cap.take()             # per layer [n_head, 32, head_dim] float32; disarmed again
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Sequence

import numpy as np

from kvlocal.runtime.library import llama_lib

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
_DTYPES = {GGML_TYPE_F32: np.dtype(np.float32), GGML_TYPE_F16: np.dtype(np.float16)}


class GgmlTensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml/include/ggml.h of the vendored llama.cpp,
    checked in this tree) — only the ones read here; the rest of the struct (op_params, flags, src,
    view_src, view_offs, data, name, extra) is never touched through this declaration (the name is read
    with ``ggml_get_name``). Never allocate it: it is a view on a tensor that ggml owns, built with
    ``from_address``.

    ``type``: enum ggml_type (GGML_TYPE_F32 = 0); ``buffer``: the backend buffer holding the data
    (device memory on a GPU, hence ``ggml_backend_tensor_get``); ``ne``: elements per dimension,
    innermost first; ``nb``: byte strides; ``op``: enum ggml_op.
    """

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
    ]


_OP_OFFSET = GgmlTensorHead.op.offset  # read in the ask phase without building a struct view


class _Ggml:
    """ctypes handles of the few ggml functions used here (llama-cpp-python binds none of them)."""

    def __init__(self):
        lib = self.lib = _ggml_base_library()

        def fn(name, restype, argtypes):
            f = lib[name]  # item access: a fresh function pointer, no argtypes shared with other modules
            f.restype, f.argtypes = restype, argtypes
            return f

        vp = ctypes.c_void_p
        self.get_name = fn("ggml_get_name", ctypes.c_char_p, [vp])
        self.op_desc = fn("ggml_op_desc", ctypes.c_char_p, [vp])
        self.op_name = fn("ggml_op_name", ctypes.c_char_p, [ctypes.c_int])
        self.nbytes = fn("ggml_nbytes", ctypes.c_size_t, [vp])
        self.tensor_get = fn("ggml_backend_tensor_get", None, [vp, vp, ctypes.c_size_t, ctypes.c_size_t])
        self.op_rope = self._op_value(b"ROPE")

    def _op_value(self, name: bytes) -> int:
        """The enum ggml_op value whose name is `name` (the enum moves between ggml versions)."""
        for op in range(1, 512):  # GGML_OP_NONE = 0; ROPE comes long before GGML_OP_COUNT
            got = self.op_name(op)
            if got == name:
                return op
            if got is None or got == b"":
                break
        raise RuntimeError(f"this ggml has no op named {name.decode()}")


def _ggml_base_library() -> ctypes.CDLL:
    """libggml-base from the directory of the libllama that llama_cpp loaded (so both are the same
    build); a build that links ggml statically into libllama exports the symbols from libllama itself."""
    llama = llama_lib()._lib
    path = getattr(llama, "_name", None)
    if path:
        folder = os.path.dirname(os.path.realpath(path))
        for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
            candidate = os.path.join(folder, name)
            if os.path.exists(candidate):
                return ctypes.CDLL(candidate)
    try:
        llama["ggml_get_name"]
    except AttributeError:
        raise RuntimeError(f"no ggml-base library next to {path} and libllama does not export ggml") from None
    return llama


@functools.lru_cache(maxsize=None)
def ggml() -> _Ggml:
    return _Ggml()


class QueryCapture:
    """Post-RoPE queries of every layer for the last ``n_last`` tokens decoded while armed.

    Pass :meth:`callback` as ``Context(..., cb_eval=cap.callback)``. One capture per context; not
    thread-safe (neither is the context). Every graph evaluated while armed contributes its rows: a
    decode split into batches (``Context.decode``) or ubatches (llama.cpp) keeps, per layer, the last
    ``n_last`` rows over all of them, in decode order.
    """

    def __init__(self, n_layer: int, n_head: int, head_dim: int, layers: Sequence[int] | None = None):
        self.n_head, self.head_dim = int(n_head), int(head_dim)
        # the model layers captured (default all): take() returns one array per entry, in this order
        self.layers = tuple(range(int(n_layer))) if layers is None else tuple(int(il) for il in layers)
        self.n_layer = len(self.layers)
        self._g = ggml()
        self._rope = self._g.op_rope
        self._get_name = self._g.get_name
        self._names = {f"Qcur-{il}".encode(): i for i, il in enumerate(self.layers)}
        self._n_last = 0
        self._rows: list[np.ndarray | None] = [None] * self.n_layer  # per layer [k, n_head, head_dim]
        self._error: BaseException | None = None
        self.n_graphs = 0  # graphs (ubatches) seen while armed, counted at layer 0
        self.stop_requested = False  # request_stop(): every graph stops at its next node

    @classmethod
    def for_model(cls, model) -> "QueryCapture":
        """A capture of a :class:`kvlocal.runtime.Model`'s full-attention layers (all layers but the
        sliding ones of an iSWA model: the ones whose cache kvlocal compresses)."""
        a = model.arch
        return cls(a.n_layer, a.n_head, a.head_dim_k, layers=a.full_layers)

    # -- state ----------------------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        return self._n_last > 0

    @property
    def n_captured(self) -> int:
        """Rows held for layer 0 (at most n_last)."""
        rows = self._rows[0]
        return 0 if rows is None else len(rows)

    def arm(self, n_last: int) -> None:
        """Capture the last `n_last` tokens of the next decode call(s); drops rows held so far."""
        if n_last < 1:
            raise ValueError("n_last must be at least 1")
        self._reset()
        self._n_last = int(n_last)

    def disarm(self) -> None:
        """Stop capturing (rows already captured stay until :meth:`take`). Disarmed, the ask phase
        answers False for every node: no graph splits, nothing copied."""
        self._n_last = 0

    def take(self) -> list[np.ndarray]:
        """Per layer, float32 ``[n_head, n, head_dim]`` of the last ``n = min(n_last, tokens decoded
        while armed)`` tokens, oldest first; then disarms and drops everything held.

        Raises RuntimeError if copying failed during the decode, if nothing was captured, or if some
        layer has no ROPE ``Qcur-N`` node (an architecture that names its queries differently).
        """
        try:
            if self._error is not None:
                raise RuntimeError(f"query capture failed during decode: {self._error!r}") from self._error
            missing = [il for il, r in enumerate(self._rows) if r is None]
            if len(missing) == self.n_layer:
                raise RuntimeError("no queries captured: arm() before decoding, and decode at least one token")
            if missing:
                missing = [self.layers[i] for i in missing]
                raise RuntimeError(f"no ROPE 'Qcur-N' node seen for layers {missing}: this architecture's graph names its queries differently")
            counts = {len(r) for r in self._rows}
            if len(counts) != 1:
                raise RuntimeError(f"layers captured different numbers of tokens ({sorted(counts)})")
            return [np.ascontiguousarray(r.transpose(1, 0, 2), dtype=np.float32) for r in self._rows]
        finally:
            self._reset()
            self._n_last = 0

    def _reset(self) -> None:
        self._rows = [None] * self.n_layer
        self._error = None
        self.n_graphs = 0

    # -- the eval callback ----------------------------------------------------------------------
    def _layer(self, t) -> int | None:
        """The layer whose post-RoPE query `t` is, or None (op checked first: one int read)."""
        if ctypes.c_int.from_address(t + _OP_OFFSET).value != self._rope:
            return None
        return self._names.get(self._get_name(t))

    def callback(self, t, ask, user_data) -> bool:
        if self.stop_requested:  # ask for the next node, then answer False: the graph split stops there
            return ask
        if not t or self._n_last == 0:
            return not ask  # disarmed: want nothing; data phase (another observer's node): go on
        if ask:
            return self._layer(t) is not None
        try:
            layer = self._layer(t)
            if layer is not None:
                self._copy(t, layer)
        except BaseException as e:  # a False here would silently skip the rest of the graph split
            if self._error is None:
                self._error = e
        return True

    def request_stop(self) -> None:
        """Make the graph being computed stop at its next node (its results are garbage: the caller
        discards them, e.g. on Ctrl-C). Cleared by :meth:`clear_stop`."""
        self.stop_requested = True

    def clear_stop(self) -> None:
        self.stop_requested = False

    def _copy(self, t: int, layer: int) -> None:
        head = GgmlTensorHead.from_address(t)
        ne, nb = tuple(head.ne), tuple(head.nb)
        dtype = _DTYPES.get(head.type)
        if dtype is None:
            raise TypeError(f"Qcur-{self.layers[layer]} has ggml type {head.type}, expected F32 or F16")
        d, h, n_tok = ne[0], ne[1], ne[2]
        if (d, h) != (self.head_dim, self.n_head) or ne[3] != 1:
            raise ValueError(f"Qcur-{self.layers[layer]} is {list(ne)}, expected [{self.head_dim}, {self.n_head}, n_tokens, 1]")
        k = min(self._n_last, n_tok)
        es = dtype.itemsize
        offset = (n_tok - k) * nb[2]
        if nb[0] == es and nb[1] == d * es and nb[2] == h * d * es:  # contiguous: one copy of k rows
            rows = np.empty((k, h, d), dtype=dtype)
            self._g.tensor_get(t, rows.ctypes.data, offset, rows.nbytes)
        else:  # strided (not seen for ROPE outputs): copy the byte span of the k rows, then view it
            span = (k - 1) * nb[2] + (h - 1) * nb[1] + (d - 1) * nb[0] + es
            raw = np.empty(-(-span // es), dtype=dtype)
            self._g.tensor_get(t, raw.ctypes.data, offset, span)
            rows = np.lib.stride_tricks.as_strided(raw, shape=(k, h, d), strides=(nb[2], nb[1], nb[0])).copy()
        if rows.dtype != np.float32:
            rows = rows.astype(np.float32)
        prev = self._rows[layer]
        if prev is not None:
            rows = np.concatenate([prev, rows])[-self._n_last:]
        self._rows[layer] = rows
        if layer == 0:
            self.n_graphs += 1
