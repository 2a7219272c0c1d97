"""Model and context on llama.cpp's low-level API.

A :class:`Context` decodes tokens at explicit positions (after eviction, cell index, position and
token index part ways) and exposes the few memory operations kvlocal needs.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from kvlocal.models.arch import ArchInfo, arch_info, gguf_meta
from kvlocal.errors import UsageError
from kvlocal.models.gguf_file import check_gguf, read_gguf
from kvlocal.runtime.library import llama_lib, patch_functions


def _no_progress(progress, user_data):
    return True


_NO_PROGRESS = None


def checks_servers(call):
    """Wrap a call that runs graphs or copies on a context's devices (its first argument: the Context): with
    rpc-servers, raise :class:`~kvlocal.errors.ServerLost` if one was lost during it — ggml-rpc then does nothing
    and reads zeros (patch 0015), so nothing it returned is used — also where the call itself failed on that
    account."""
    @functools.wraps(call)
    def checked(ctx, *args, **kwargs):
        if not ctx.model.rpc:
            return call(ctx, *args, **kwargs)
        try:
            out = call(ctx, *args, **kwargs)
        except (RuntimeError, ValueError):
            ctx.model.check_servers()
            raise
        llama_lib().llama_synchronize(ctx._ptr)  # a loss is found by ggml-rpc's thread, after the op was sent
        ctx.model.check_servers()
        return out
    return checked


def default_threads() -> int:
    """The cores this process may run on (a cpuset or ``taskset`` narrows them), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 8))


class Model:
    """A GGUF model loaded by llama.cpp: weights, vocabulary, metadata, chat template."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, rpc: Sequence[str] | str = (),
                 tensor_split: Sequence[float] | None = None):
        """``n_gpu_layers``: the last layers (and their KV cache) that go to the devices, the others stay on the
        CPU; ``rpc``: llama.cpp rpc-servers (``host:port``) whose devices come first among those devices, as with
        llama.cpp's ``--rpc`` (kvlocal.runtime.rpc); ``tensor_split``: each device's share of those layers
        (the RPC devices, server after server, then this machine's GPUs; None: by their free memory)."""
        self.path = Path(path)
        check_gguf(self.path)
        # refuse what kvlocal cannot score before llama.cpp loads anything
        reader = read_gguf(self.path)
        self.arch: ArchInfo = arch_info(gguf_meta(reader), self.path.name)
        self._tensor_names = frozenset(t.name for t in reader.tensors)
        global _NO_PROGRESS
        lib = llama_lib()
        if _NO_PROGRESS is None:
            _NO_PROGRESS = lib.llama_progress_callback(_no_progress)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        self.n_gpu_layers = n_gpu_layers
        self.rpc, self.devices = self._place(params, rpc, tensor_split)
        params.progress_callback = _NO_PROGRESS  # llama.cpp prints dots to stderr otherwise
        self._ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._ptr:
            raise UsageError(f"llama.cpp could not load {self.path}: the file may be damaged or of an unsupported architecture; re-download it (`kvlocal pull`)")
        self._vocab = lib.llama_model_get_vocab(self._ptr)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.n_layer = lib.llama_model_n_layer(self._ptr)
        self.n_head = lib.llama_model_n_head(self._ptr)
        self.n_head_kv = lib.llama_model_n_head_kv(self._ptr)
        self.n_embd = lib.llama_model_n_embd(self._ptr)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self._ptr)
        if arch_info(self.meta, self.path.name) != self.arch:
            self.close()
            raise UsageError(f"{self.path.name}: llama.cpp reads other attention hyperparameters than the file's header says")
        if self.arch.n_swa and lib.llama_model_n_swa(self._ptr) != self.arch.n_swa:
            self.close()
            raise UsageError(f"{self.path.name}: llama.cpp reads a sliding window of {lib.llama_model_n_swa(self._ptr)}, "
                             f"the metadata says {self.arch.n_swa}: this file is not what kvlocal was checked against")

    def check_servers(self) -> None:
        """Raise :class:`~kvlocal.errors.ServerLost` if an rpc-server of this model was lost: its layers and their
        KV cache are gone, so no context of this model can go on (load the model again once it is back)."""
        if self.rpc:
            from kvlocal.runtime import rpc as remote

            remote.check_lost(self.rpc)

    def _place(self, params, rpc, tensor_split) -> tuple[tuple[str, ...], list[str]]:
        """Set the devices and the split of ``params``: (the rpc endpoints, each device's name). Without ``rpc``
        and ``tensor_split`` llama.cpp picks the devices itself, as before."""
        from kvlocal.runtime import rpc as remote

        endpoints = remote.parse_endpoints(rpc)
        self.remote = False  # some layers (and their KV cache) on an rpc-server
        if not endpoints and tensor_split is None:
            return (), []
        devices = remote.remote_devices(endpoints) + remote.local_gpus()
        self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated; kept alive
        params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split is not None:
            shares = [float(x) for x in tensor_split]
            if len(shares) != len(devices) or min(shares, default=0) < 0 or not sum(shares):
                names = ", ".join(remote.device_name(d) for d in devices) or "none"
                raise UsageError(f"--tensor-split {','.join(map(str, shares))}: give one non-negative share per "
                                 f"device, not all 0 ({len(devices)}: {names})")
            self._split = (ctypes.c_float * llama_lib().llama_max_devices())(*shares)
            params.tensor_split = self._split
        n_remote = len(devices) - len(remote.local_gpus())  # the RPC devices come first
        self.remote = self.n_gpu_layers != 0 and n_remote > 0 and (tensor_split is None or sum(shares[:n_remote]) > 0)
        return endpoints, [remote.device_name(d) for d in devices]

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            llama_lib().llama_model_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except TypeError:  # at interpreter exit, llama_cpp's module globals may already be gone
            pass

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_lib().llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    @property
    def rope_type(self) -> int:
        """llama.cpp's rotation of q and k (``llama_rope_type``: -1 none, 0 adjacent pairs, 2 NeoX halves, ...)."""
        return int(llama_lib().llama_model_rope_type(self._ptr))

    @property
    def rope_freq_scale(self) -> float:
        """The frequency scale llama.cpp trained positions with (1 / the linear scaling factor)."""
        return float(llama_lib().llama_model_rope_freq_scale_train(self._ptr))

    def has_tensor(self, name: str) -> bool:
        """Whether the GGUF file holds a tensor of this name."""
        return name in self._tensor_names

    def desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama_lib().llama_model_desc(self._ptr, buf, len(buf))
        return buf.value.decode(errors="replace")

    # -- tokens -------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        lib = llama_lib()
        data = text.encode()
        n_max = len(data) + 8
        buf = (lib.llama_token * n_max)()
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = (lib.llama_token * -n)()
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_lib().llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_lib().llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode(errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_lib().llama_vocab_is_eog(self._vocab, token))

    def chat_prompt(self, messages: list[dict], add_assistant: bool = True, tools: list[dict] | None = None) -> str:
        """Render messages (and tool definitions) with the model's chat template: the GGUF's Jinja template,
        else llama.cpp's built-in one (see runtime/chat_template.py)."""
        from kvlocal.runtime.chat_template import chat_template

        return chat_template(self).render(messages, add_assistant, tools)

    @property
    def tool_format(self) -> str | None:
        """How this model writes tool calls (``hermes``: Qwen 2.5/3 and others, ``llama3``; kvlocal/chat/toolcalls.py),
        or None when its chat template does not take tools."""
        from kvlocal.runtime.chat_template import chat_template

        return chat_template(self).tool_format


class Context:
    """A llama.cpp context with one sequence (id 0) whose tokens kvlocal places itself.

    Not thread-safe: one thread at a time may decode in a context.
    """

    def __init__(
        self,
        model: Model,
        n_ctx: int,
        n_batch: int = 512,
        flash_attn: bool = False,
        n_threads: int | None = None,
        rope_freq_base: float = 0.0,
        type_k: int | None = None,
        type_v: int | None = None,
        cb_eval=None,
        offload_kqv: bool = True,
    ):
        """``offload_kqv``: False keeps the KV cache (and attention over it) in host memory where the model's layers
        are on a GPU (llama.cpp's ``--no-kv-offload``); on a CPU it changes nothing."""
        lib = llama_lib()
        self.model = model
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, N_UBATCH)
        params.swa_full = False  # as llama-cli: a sliding-window cache of n_swa + n_ubatch cells, not n_ctx
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads or default_threads()
        self.n_threads = params.n_threads  # llama.cpp's threads; kvlocal's scoring uses as many
        # AUTO turns flash attention on, which removes kq_soft_max and is slower for decode on CPU
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.offload_kqv = offload_kqv
        self.flash_attn, self.offload_kqv = flash_attn, offload_kqv
        params.rope_freq_base = rope_freq_base
        self.type_k, self.type_v = type_k, type_v  # None: llama.cpp's default (F16)
        if type_k is not None:
            params.type_k = type_k
        if type_v is not None:
            params.type_v = type_v
        if cb_eval is not None:
            self._cb_eval = lib.ggml_backend_sched_eval_callback(cb_eval)
            params.cb_eval = self._cb_eval
        self._ptr = lib.llama_init_from_model(model._ptr, params)
        if not self._ptr:
            raise UsageError(f"llama.cpp could not create a context of {n_ctx} cells: lower -c/--ctx-size or --budget")
        self.n_ctx = lib.llama_n_ctx(self._ptr)
        self.n_ubatch = params.n_ubatch
        self.n_batch = n_batch
        a = model.arch
        if a.has_swa and self.n_ctx > a.n_swa:
            # the sliding cache holds the n_swa - 1 tokens before a batch plus the batch itself, whatever
            # the full cache holds (fewer cells once kvlocal compressed it): batches must fit that
            swa_cells = swa_cache_cells(a, self.n_ctx, self.n_ubatch)
            self.n_batch = min(n_batch, swa_cells - a.n_swa + 1)
        self._mem = lib.llama_get_memory(self._ptr)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            lib = llama_lib()
            if getattr(self, "_batch", None) is not None:
                lib.llama_batch_free(self._batch)
            lib.llama_free(self._ptr)
            self._ptr = None

    __del__ = close

    @checks_servers
    def decode(self, tokens: Sequence[int], positions: Sequence[int] | None = None, logits: str | int = "last") -> np.ndarray:
        """Decode tokens into sequence 0 at the given positions (default: after the last one held).

        logits: "last" returns [n_vocab] for the last token, an int i returns [n_vocab] for token i,
        "all" returns [T, n_vocab], "none" returns an empty array. Long inputs are split into batches
        of n_batch.
        """
        lib = llama_lib()
        if positions is None:
            start = self.pos_max() + 1
            positions = range(start, start + len(tokens))
        if len(positions) != len(tokens):
            raise ValueError("tokens and positions differ in length")
        want = len(tokens) - 1 if logits == "last" else logits
        out = []
        for b0 in range(0, len(tokens), self.n_batch):
            b1 = min(b0 + self.n_batch, len(tokens))
            batch = self._batch
            batch.n_tokens = b1 - b0
            for j, i in enumerate(range(b0, b1)):
                batch.token[j] = tokens[i]
                batch.pos[j] = positions[i]
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = logits == "all" or i == want
            rc = lib.llama_decode(self._ptr, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}): the context of {self.n_ctx} cells may be full")
            if logits == "all":
                ptr = lib.llama_get_logits(self._ptr)
                out.append(np.ctypeslib.as_array(ptr, shape=(b1 - b0, self.model.n_vocab)).copy())
            elif isinstance(want, int) and b0 <= want < b1:
                ptr = lib.llama_get_logits_ith(self._ptr, want - b0)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy())
        if logits == "all":
            return np.concatenate(out)
        if out:
            return out[0]
        return np.empty(0, dtype=np.float32)

    # -- memory ---------------------------------------------------------------------------------
    def pos_max(self) -> int:
        return llama_lib().llama_memory_seq_pos_max(self._mem, 0)

    def clear(self) -> None:
        llama_lib().llama_memory_clear(self._mem, True)

    def remove(self, p0: int, p1: int = -1) -> None:
        """Remove the tokens at positions [p0, p1) of sequence 0 (p1 < 0: to the end)."""
        if not llama_lib().llama_memory_seq_rm(self._mem, 0, p0, p1):
            raise RuntimeError(f"llama_memory_seq_rm({p0}, {p1}) failed")

    def shift(self, p0: int, p1: int, delta: int) -> None:
        """Add ``delta`` to the positions [p0, p1) of sequence 0 (p1 < 0: to the end). llama.cpp re-rotates
        the keys (its K-shift graph, on the cache's device) at the next decode; a cell whose position
        would fall below 0 is removed."""
        llama_lib().llama_memory_seq_add(self._mem, 0, p0, p1, delta)

    def kv_bytes(self) -> tuple[int, int] | None:
        """(full-attention cache, sliding-window cache) bytes llama.cpp allocated for this context's K/V
        buffers, as its backends report them (the patched runtime's ``llama_memory_buffer_size``);
        None on a stock runtime."""
        fn = patch_functions()["buffer_size"]
        if fn is None:
            return None
        return int(fn(self._mem, 0)), int(fn(self._mem, 1))

    @checks_servers
    def bias(self, il: int) -> np.ndarray:
        """``[n_head_kv, n]`` float32 attention bias of layer ``il`` for the cells of sequence 0, in
        :meth:`cells` order (0 unless set; ``log(count)`` for merged entries, ``-inf`` for unused ones)."""
        fn = self._bias_fn("get_bias")
        hkv = self.model.arch.n_head_kv
        llama_lib().llama_synchronize(self._ptr)  # a decode may still run on a device: the bias is copied directly
        n = fn(self._mem, 0, il, None, 0)
        if n < 0:
            raise ValueError(f"llama_memory_seq_get_bias: no KV layer {il} in this context's cache")
        out = np.zeros((hkv, n), dtype=np.float32)
        if n:
            fn(self._mem, 0, il, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        return out

    @checks_servers
    def set_bias(self, il: int, bias: np.ndarray) -> None:
        """Set layer ``il``'s attention bias ``[n_head_kv, n]`` for the cells of sequence 0 (:meth:`cells` order)."""
        fn = self._bias_fn("set_bias")
        b = np.ascontiguousarray(bias, dtype=np.float32)
        llama_lib().llama_synchronize(self._ptr)
        if fn(self._mem, 0, il, b.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), b.size) < 0:
            raise ValueError(f"llama_memory_seq_set_bias refused layer {il} with shape {np.shape(bias)} "
                             f"(needs [n_head_kv, cells of sequence 0])")

    def counters(self) -> dict:
        """What kvlocal's functions cost this context so far (``llama_kvlocal_get_counters``, patch ABI 17):
        ``transfers``, the copies between the host and the cache's backends that compactions, merges, scores
        and row copies made; ``compute_bytes``, the decode's compute buffers, which kvlocal's graphs never grow
        (they run on a scheduler of their own); ``kv_compute_peak``, the largest buffers one of kvlocal's graphs took
        and gave back. A stock runtime ran none of them: zeros."""
        fn = patch_functions()["counters"]
        if fn is None:
            return {"transfers": 0, "compute_bytes": 0, "kv_compute_peak": 0}
        c = fn(self._ptr)
        return {"transfers": int(c.n_transfers), "compute_bytes": int(c.compute_bytes), "kv_compute_peak": int(c.kv_compute_peak)}

    def bias_cells(self) -> int:
        """(layer, cell) pairs of the cache that may hold a non-zero bias (``llama_memory_bias_cells``, patch
        0007): only these are ever cleared, and at 0 the graphs leave the bias out."""
        return int(self._bias_fn("bias_cells")(self._mem))

    @checks_servers
    def compact(self, src: np.ndarray, pos: np.ndarray, bias: np.ndarray | None = None) -> None:
        """Rewrite the cells of sequence 0 on their device (``llama_kv_compact``, patch 0009): afterwards it
        holds ``B = len(pos)`` cells, the first ``B`` of :meth:`cells`, and in compressed layer ``l`` and KV
        head ``h`` cell ``j`` holds the row cell ``src[l, h, j]`` held (an index into :meth:`cells` order,
        ``-1``: left as is), at position ``pos[j]``; ``bias`` ``[n_layer, Hkv, B]`` the new attention bias
        (None: 0). No K/V row leaves the device. Raises ValueError if llama.cpp refuses."""
        fn = patch_functions()["compact"]
        if fn is None:
            raise UsageError("on-device compaction needs kvlocal's patched llama.cpp (patch 0009): run `python ggml_patches/build.py`")
        src = np.ascontiguousarray(src, dtype=np.int32)
        pos = np.ascontiguousarray(pos, dtype=np.int32)
        b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        if src.ndim != 3 or src.shape[2] != len(pos) or (b is not None and b.shape != src.shape):
            raise ValueError(f"compact: src {src.shape}, pos {pos.shape}, bias {None if b is None else b.shape} do not match")
        rc = fn(self._ptr, 0, len(pos), src.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                None if b is None else b.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        if rc < 0:
            why = {-2: "a quantized row of one block (it cannot move as bytes)", -3: "the graph failed"}.get(rc, "invalid arguments")
            raise ValueError(f"llama_kv_compact refused: {why}")

    @checks_servers
    def score(self, q: np.ndarray, scale: float, bias: np.ndarray | None = None,
              vnorm_cells: np.ndarray | None = None, outside: np.ndarray | None = None, norm_p: int = 1):
        """Score the cells of sequence 0 on their device (``llama_kv_score``, patch 0010).

        ``q``: ``[n_layer, Hq, w, d]`` float32 window queries after RoPE, as the model computed them (a quantized
        cache's rotated basis is applied on the device) (the compressed layers), logits
        ``scale * q·k + bias`` (``bias`` ``[n_layer, Hkv, n]``, None: 0). Returns the softmax attention of
        each query head averaged over the window, ``[n_layer, Hq, n]`` (cells in :meth:`cells` order), and
        for the cells ``vnorm_cells`` the projected value norm ``mean_h ||v · W_O^h||_p`` (``p = norm_p``, 1 or 2)
        over each KV head's query heads, ``[n_layer, Hkv, len(vnorm_cells)]`` (None without cells). ``outside``
        ``[n_layer, Hq, w]``: the log of a softmax mass outside the cells (rows on the host), normalized
        over with them; then a third result, each query's softmax weight of it ``[n_layer, Hq, w]``."""
        fn = patch_functions()["score"]
        if fn is None:
            raise UsageError("on-device scoring needs kvlocal's patched llama.cpp (patch 0010): run `python ggml_patches/build.py`")
        q = np.ascontiguousarray(q, dtype=np.float32)
        n_layer, hq, w, _ = q.shape
        n = len(self.cells()[0])
        hkv = self.model.n_head_kv
        b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        if b is not None and b.shape != (n_layer, hkv, n):
            raise ValueError(f"score: bias {b.shape} is not [{n_layer}, {hkv}, {n}]")
        cells = np.ascontiguousarray(np.zeros(0) if vnorm_cells is None else vnorm_cells, dtype=np.int32)
        attn = np.empty((n_layer, hq, n), dtype=np.float32)
        vnorm = np.empty((n_layer, hkv, len(cells)), dtype=np.float32)
        x = None if outside is None else np.ascontiguousarray(outside, dtype=np.float32)
        if x is not None and x.shape != (n_layer, hq, w):
            raise ValueError(f"score: outside {x.shape} is not [{n_layer}, {hq}, {w}]")
        x_attn = np.empty((n_layer, hq, w), dtype=np.float32)
        f32 = ctypes.POINTER(ctypes.c_float)
        rc = fn(self._ptr, 0, q.ctypes.data_as(f32), w, float(scale), None if b is None else b.ctypes.data_as(f32),
                attn.ctypes.data_as(f32), cells.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(cells),
                vnorm.ctypes.data_as(f32), int(norm_p), None if x is None else x.ctypes.data_as(f32),
                None if x is None else x_attn.ctypes.data_as(f32))
        if rc != n:
            raise ValueError(f"llama_kv_score refused: {'the graph failed' if rc == -3 else 'invalid arguments'}")
        out = attn, (vnorm if len(cells) else None)
        return out if x is None else (*out, x_attn)

    @checks_servers
    def get_rows(self, l: int, cells: np.ndarray, heads: np.ndarray, row_k: int, row_v: int) -> tuple[np.ndarray, np.ndarray]:
        """The K and V rows of KV head ``heads[i]`` in cell ``cells[i]`` (an index into :meth:`cells` order) of
        compressed layer ``l``, as the cache stores them: uint8 ``[n, row_k]`` and ``[n, row_v]`` (``llama_kv_rows_get``,
        patch 0011). Only these rows leave the device."""
        cells, heads = _index(cells), _index(heads)
        k = np.empty((len(cells), row_k), np.uint8)
        v = np.empty((len(cells), row_v), np.uint8)
        self._rows("rows_get", l, cells, heads, k, v)
        return k, v

    @checks_servers
    def set_rows(self, l: int, cells: np.ndarray, heads: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Write rows as :meth:`get_rows` returns them into the cells (``llama_kv_rows_set``, patch 0011)."""
        self._rows("rows_set", l, _index(cells), _index(heads), np.ascontiguousarray(k, np.uint8), np.ascontiguousarray(v, np.uint8))

    @checks_servers
    def merge(self, n_merge: np.ndarray, cells: np.ndarray, heads: np.ndarray, wk: np.ndarray, wv: np.ndarray) -> None:
        """Merge rows of the compressed layers on their device in one graph (``llama_kv_merge``, patch 0013):
        ``n_merge[l]`` merges of layer ``l``, listed layer after layer; merge ``i``'s row of KV head ``heads[i]`` in
        cell ``cells[i, -1]`` becomes ``Σ_g wk[i, g] K(cells[i, g])`` and ``Σ_g wv[i, g] V(cells[i, g])`` (``cells``
        ``[N, G]`` indices into :meth:`cells` order, ``-1``: padding), summed in float32 and stored in the cache's
        type. Only indices and weights cross."""
        n_merge, cells, heads = _index(n_merge), _index(cells), _index(heads)
        wk, wv = np.ascontiguousarray(wk, np.float32), np.ascontiguousarray(wv, np.float32)
        if (cells.ndim != 2 or wk.shape != cells.shape or wv.shape != cells.shape or heads.shape != cells.shape[:1]
                or n_merge.sum() != len(cells)):
            raise ValueError(f"merge: n_merge {n_merge.sum()}, cells {cells.shape}, heads {heads.shape}, wk {wk.shape}, "
                             f"wv {wv.shape} do not match")
        i32, f32 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
        rc = self._patch_fn("merge", "0013")(self._ptr, 0, n_merge.ctypes.data_as(i32), max(cells.shape[1], 1),
                                             cells.ctypes.data_as(i32), heads.ctypes.data_as(i32), wk.ctypes.data_as(f32),
                                             wv.ctypes.data_as(f32))
        if rc != len(cells):
            why = "the graph failed" if rc == -3 else "a cell, head or layer count that does not match the cache, or two merges into one row"
            raise ValueError(f"llama_kv_merge refused: {why}")

    def _rows(self, name: str, l: int, cells: np.ndarray, heads: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        if len(cells) != len(heads) or len(k) != len(cells) or len(v) != len(cells):
            raise ValueError(f"{name}: {len(cells)} cells, {len(heads)} heads, {len(k)} K rows, {len(v)} V rows")
        i32 = ctypes.POINTER(ctypes.c_int32)
        rc = self._patch_fn(name, "0011")(self._ptr, 0, l, len(cells), cells.ctypes.data_as(i32), heads.ctypes.data_as(i32),
                                          k.ctypes.data, k.shape[1], v.ctypes.data, v.shape[1])
        if rc != len(cells):
            why = "the graph failed" if rc == -3 else "a cell, head or row size that does not match the cache"
            raise ValueError(f"llama_kv_{name} refused layer {l} ({why})")

    @staticmethod
    def _patch_fn(name: str, patch: str):
        fn = patch_functions()[name]
        if fn is None:
            raise UsageError(f"this needs kvlocal's patched llama.cpp (patch {patch}): run `python ggml_patches/build.py`")
        return fn

    @staticmethod
    def _bias_fn(name: str):
        fn = patch_functions()[name]
        if fn is None:
            raise UsageError("the attention bias needs kvlocal's patched llama.cpp: run `python ggml_patches/build.py`")
        return fn

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """(cell indices, positions) held by sequence 0, in cell order. Needs the patched runtime."""
        fn = patch_functions()["seq_cells"]
        if fn is None:
            raise UsageError("listing KV cells needs kvlocal's patched llama.cpp: run `python ggml_patches/build.py`")
        n = fn(self._mem, 0, None, None, 0)
        if n < 0:
            raise RuntimeError("llama_memory_seq_cells: this model's memory is not a single KV cache")
        cells = np.zeros(n, dtype=np.int32)
        pos = np.zeros(n, dtype=np.int32)
        if n:
            fn(self._mem, 0, cells.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
        return cells, pos


def _index(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def swa_cache_cells(arch: ArchInfo, n_ctx: int, n_ubatch: int = 512) -> int:
    """Cells of the sliding-window cache llama.cpp creates next to an n_ctx-cell one (swa_full off):
    ``min(n_ctx, n_swa + n_ubatch)`` padded to 256 (src/llama-kv-cache-iswa.cpp)."""
    return -(-min(n_ctx, arch.n_swa + n_ubatch) // 256) * 256


def kv_cache_bytes(model: Model, n_ctx: int, n_ubatch: int = 512, bytes_per_elem: float = 2.0,
                   bias: bool = True) -> tuple[int, int]:
    """(full-attention, sliding-window) bytes that llama.cpp allocates for a context of n_ctx cells
    (already padded) of an F16 cache: ``n_cells · ((head_dim_k + head_dim_v) · bytes + 4) · n_head_kv`` per
    layer (K, V and the patched runtime's F32 attention bias per cell and KV head), the sliding layers
    over :func:`swa_cache_cells`. ``bias=False``: what a stock llama.cpp allocates (no bias). The formula that measured figures
    (:meth:`Context.kv_bytes`) are checked against, and the estimate on a stock runtime."""
    a = model.arch
    row = ((a.head_dim_k + a.head_dim_v) * bytes_per_elem + (BIAS_BYTES if bias else 0)) * a.n_head_kv
    n_full = len(a.full_layers)
    full = int(n_full * n_ctx * row)
    if not a.has_swa:
        return full, 0
    return full, int((a.n_layer - n_full) * swa_cache_cells(a, n_ctx, n_ubatch) * row)


N_UBATCH = 512  # kvlocal's contexts: n_ubatch = min(n_batch, 512)
BIAS_BYTES = 4  # the patched cache's F32 attention bias per cell and KV head (patch 0007)


def pad_cells(n: int) -> int:
    """The n_ctx llama.cpp really allocates for n cells: rounded up to a multiple of 256."""
    return -(-n // 256) * 256
