"""GGUF → hyperparameters and float32 torch weights for the reference model.

Tensors are found by kvlocal's GGUF header reader (:mod:`kvlocal.models.gguf_header`, checked against
gguf-py's ``GGUFReader`` by the tests) and dequantized with gguf's own ``gguf.quants.dequantize``: the
reference must not carry a second implementation of the block formats.

Shape order: GGUF lists a tensor's dimensions as ggml's ``ne`` — fastest-varying first — so a linear
layer from ``n_embd`` to ``n_ff`` is ``[n_embd, n_ff]`` in GGUF and ``[n_ff, n_embd]`` (out, in) in numpy
and torch, which is exactly ``nn.Linear``'s layout. Every tensor is reshaped to ``reversed(ne)`` and the
result is checked against the shape the architecture implies.

llama.cpp conventions that the forward pass depends on, decided here from the file:

- ``rope_type``: llama.cpp rotates adjacent pairs ``(x[2i], x[2i+1])`` ("norm", GPT-J style) for ``llama``
  — convert_hf_to_gguf permutes the HF q/k rows so that this equals HF's half-split rotation — and
  rotates ``(x[i], x[i + d/2])`` ("neox") on unpermuted rows for ``qwen2``, ``qwen3`` and ``gemma3``.
- head sizes, the attention scale and the sliding-window layers come from :func:`kvlocal.models.arch.arch_info`,
  the one description of attention that the engine uses too.
- ``gemma3`` (src/models/gemma3.cpp): embeddings times ``sqrtf(n_embd)``, GELU (tanh) gated FFN, norms
  after attention and FFN, sliding layers with their own RoPE base (``rope.freq_base_swa``, default
  10000) and no RoPE scaling, optional ``final_logit_softcapping``. Norm weights are used as stored:
  convert_hf_to_gguf already added Gemma's ``1 +``.
- ``rope_scale``: llama.cpp reads ``rope.scaling.factor`` (or the old ``rope.scale_linear``) for every
  scaling type and uses ``freq_scale = 1/factor``; the scaling type defaults to ``linear``. Only
  ``none`` and ``linear`` are reproduced here; YaRN and LongRoPE raise :class:`UsageError`.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlocal.models.arch import arch_info, gguf_meta
from kvlocal.errors import UsageError
from kvlocal.models import gguf_file

# architecture → how llama.cpp rotates q/k (llama_model_rope_type)
ROPE_TYPES = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}

# llama_ftype values written as general.file_type (gguf.LlamaFileType), for messages
FILE_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
    18: "Q6_K", 32: "BF16",
}


@dataclass
class ModelArgs:
    arch: str  # general.architecture: one of ROPE_TYPES
    n_layer: int
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (GQA: n_head is a multiple)
    n_embd: int  # residual width
    head_dim: int  # attention.key_length, else n_embd // n_head
    n_ff: int  # gated FFN hidden width
    n_vocab: int
    norm_eps: float  # RMSNorm epsilon
    rope_base: float  # rope.freq_base (10000 when absent, as in llama.cpp)
    rope_scale: float = 1.0  # linear scaling factor: angles are divided by it
    rope_type: str = "norm"  # "norm" (adjacent pairs) or "neox" (halves)
    n_rot: int = 0  # rotated dimensions per head (rope.dimension_count), = head_dim here
    attn_scale: float = 0.0  # multiplies q·k (arch_info: 1/sqrt(head_dim) unless the model says otherwise)
    swa: tuple[bool, ...] = ()  # per layer: True for a sliding-window layer (gemma3)
    n_swa: int = 0  # sliding window: a query at P sees keys at p with P - p < n_swa
    rope_base_swa: float = 10000.0  # RoPE base of the sliding layers (they have no RoPE scaling)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (gemma3: sqrt(n_embd))
    ffn_act: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gemma3)
    logit_softcap: float = 0.0  # logits → c·tanh(logits/c) when > 0 (final_logit_softcapping)
    tied_embeddings: bool = False  # no output.weight: logits use token_embd
    weight_type: str = "F32"  # dominant type of the 2D weights (by element count)
    file_type: str | None = None  # general.file_type as a name, if the file says


# -- metadata ----------------------------------------------------------------------------------


def _field(header, key: str, default=None):
    return header.get(key, default)


def _int_field(reader, key: str, default=None, path: Path | None = None) -> int:
    value = _field(reader, key, default)
    if value is None:
        raise UsageError(f"{path}: metadata key {key} is missing; the file is not a complete {key.split('.')[0]} model")
    if isinstance(value, list):
        raise UsageError(f"{path}: {key} varies per layer ({value[:4]}...); the reference supports uniform layers only")
    return int(value)


def read_args(reader, path: Path, tensor_types: dict[str, str], tensor_shapes: dict[str, tuple]) -> ModelArgs:
    """Hyperparameters from GGUF metadata, with llama.cpp's defaults."""
    for key in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        _int_field(reader, f"{_field(reader, 'general.architecture')}.{key}", 0, path)  # UsageError if per layer
    info = arch_info(gguf_meta(reader), str(path))  # UsageError for an architecture kvlocal refuses
    arch = a = info.arch
    if _field(reader, f"{a}.expert_count", 0):
        raise UsageError(f"{path}: mixture-of-experts models are not supported by the reference model")
    n_embd, n_head, n_head_kv, head_dim = info.n_embd, info.n_head, info.n_head_kv, info.head_dim_k
    if info.head_dim_v != head_dim:
        raise UsageError(f"{path}: value heads differ in size from key heads; not supported by the reference model")
    if n_head % n_head_kv:
        raise UsageError(f"{path}: {n_head} query heads is not a multiple of {n_head_kv} KV heads")
    n_rot = _int_field(reader, f"{a}.rope.dimension_count", head_dim, path=path)

    scaling = _field(reader, f"{a}.rope.scaling.type", "linear")
    factor = _field(reader, f"{a}.rope.scaling.factor") or _field(reader, f"{a}.rope.scale_linear") or 0.0
    factor = float(factor)
    if scaling not in ("none", "linear"):
        raise UsageError(f"{path}: RoPE scaling {scaling!r} is not supported by the reference (only none and linear)")
    if float(_field(reader, f"{a}.rope.scaling.attn_factor", 1.0)) != 1.0:
        raise UsageError(f"{path}: rope.scaling.attn_factor is not supported by the reference model")
    rope_scale = factor if (scaling == "linear" and factor > 0) else 1.0

    # dominant type of the 2D weights, by number of elements (what decides the numerical error)
    sizes: Counter = Counter()
    for name, typ in tensor_types.items():
        shape = tensor_shapes[name]
        if len(shape) == 2:
            sizes[typ] += int(shape[0]) * int(shape[1])
    file_type = _field(reader, "general.file_type")
    emb_shape = tensor_shapes.get("token_embd.weight")
    if emb_shape is None:
        raise UsageError(f"{path}: no token_embd.weight tensor")
    gemma = arch == "gemma3"
    return ModelArgs(
        arch=arch,
        n_layer=info.n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd=n_embd,
        head_dim=head_dim,
        n_ff=_int_field(reader, f"{a}.feed_forward_length", path=path),
        n_vocab=int(emb_shape[1]),  # ne = [n_embd, n_vocab]
        norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scale=rope_scale,
        rope_type=ROPE_TYPES[arch],
        n_rot=n_rot,
        attn_scale=info.attn_scale,
        swa=info.swa,
        n_swa=info.n_swa,
        rope_base_swa=float(_field(reader, f"{a}.rope.freq_base_swa", 10000.0)),
        embed_scale=math.sqrt(n_embd) if gemma else 1.0,
        ffn_act="gelu_tanh" if gemma else "silu",
        logit_softcap=float(_field(reader, f"{a}.final_logit_softcapping", 0.0) or 0.0) if gemma else 0.0,
        tied_embeddings="output.weight" not in tensor_types,
        weight_type=sizes.most_common(1)[0][0] if sizes else "F32",
        file_type=FILE_TYPE_NAMES.get(int(file_type), str(file_type)) if file_type is not None else None,
    )


# -- tensors -----------------------------------------------------------------------------------

# per-layer tensors the reference knows; anything else in a block would change the math
_LAYER_TENSORS = {
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight",
    "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_qkv.bias", "attn_output.weight", "attn_output.bias",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
    "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias",
}
_GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", "output.bias"}
# what each architecture adds, all required by llama.cpp's loader (per layer; rope_freqs is global and
# optional: llama-3 frequency factors, which only llama's graph applies)
_QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")  # RMSNorm over each head's vector, before RoPE
ARCH_LAYER_TENSORS = {
    "llama": (), "qwen2": (), "qwen3": _QK_NORMS,
    "gemma3": _QK_NORMS + ("post_attention_norm.weight", "post_ffw_norm.weight"),
}
ARCH_GLOBAL_TENSORS = {"llama": {"rope_freqs.weight"}}


def dequantize_tensor(tensor, path: Path | None = None) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in numpy/torch order (``reversed(ne)``)."""
    return torch.from_numpy(gguf_file.dequantize_tensor(tensor, path))


def open_gguf(path: str | os.PathLike):
    """(path, GGUFHeader) of a complete GGUF file; the header is the process-wide one of
    :func:`kvlocal.models.gguf_file.read_gguf` (parsed once), and every error message is check_gguf's."""
    return Path(path), gguf_file.read_gguf(path)


def load_gguf(path: str | os.PathLike) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Read a GGUF file: its hyperparameters and every tensor dequantized to float32.

    Names keep GGUF's (``blk.3.attn_q.weight``). Raises :class:`UsageError` for architectures,
    tensors or types the reference cannot reproduce.
    """
    path, reader = open_gguf(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    args = read_args(reader, path, types, shapes)

    weights = {}
    for tensor in reader.tensors:
        name = tensor.name
        parts = name.split(".", 2)
        extra = ARCH_LAYER_TENSORS[args.arch]
        known = (name in _GLOBAL_TENSORS or name in ARCH_GLOBAL_TENSORS.get(args.arch, ())
                 or (parts[0] == "blk" and len(parts) == 3 and (parts[2] in _LAYER_TENSORS or parts[2] in extra)))
        if not known:
            raise UsageError(f"{path}: tensor {name} is not part of a plain {args.arch} model; "
                             "the reference cannot run it")
        weights[name] = dequantize_tensor(tensor, path)
    _check_shapes(args, weights, path)
    return args, weights


def _check_shapes(args: ModelArgs, w: dict[str, torch.Tensor], path: Path) -> None:
    """Catch a transposed or mis-sized tensor here rather than as a wrong logit later."""
    d, hd = args.n_embd, args.head_dim
    q, kv = args.n_head * hd, args.n_head_kv * hd
    want = {"token_embd.weight": (args.n_vocab, d), "output_norm.weight": (d,), "output.weight": (args.n_vocab, d)}
    for i in range(args.n_layer):
        b = f"blk.{i}."
        want.update({
            b + "attn_norm.weight": (d,), b + "ffn_norm.weight": (d,),
            b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d), b + "attn_v.weight": (kv, d),
            b + "attn_qkv.weight": (q + 2 * kv, d), b + "attn_qkv.bias": (q + 2 * kv,),
            b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
            b + "attn_output.weight": (d, q), b + "attn_output.bias": (d,),
            b + "ffn_gate.weight": (args.n_ff, d), b + "ffn_up.weight": (args.n_ff, d),
            b + "ffn_down.weight": (d, args.n_ff),
            b + "ffn_gate.bias": (args.n_ff,), b + "ffn_up.bias": (args.n_ff,), b + "ffn_down.bias": (d,),
            b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,),
            b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,),
        })
        required = ("attn_norm", "ffn_norm", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        for name in (*(f"{x}.weight" for x in required), *ARCH_LAYER_TENSORS[args.arch]):
            if b + name not in w:
                raise UsageError(f"{path}: tensor {b + name} is missing")
        if b + "attn_qkv.weight" not in w and not all(b + f"attn_{x}.weight" in w for x in "qkv"):
            raise UsageError(f"{path}: layer {i} has no attention q/k/v weights")
    if "output_norm.weight" not in w:
        raise UsageError(f"{path}: tensor output_norm.weight is missing")
    want["rope_freqs.weight"] = (args.n_rot // 2,)
    for name, t in w.items():
        if name in want and tuple(t.shape) != want[name]:
            raise UsageError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {want[name]}")
