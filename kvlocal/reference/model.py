"""A readable float32 forward pass of llama.cpp's ``llama``, ``qwen2``, ``qwen3`` and ``gemma3`` graphs, in PyTorch.

What it is for: the exact numbers that compression is judged against. It reads the same GGUF file as
llama.cpp, computes everything in float32 from dequantized weights, and keeps its keys and values in
the explicit :class:`~kvlocal.reference.cache.KVCache`, where per-head kept sets, merge counts and a
``log(count)`` bias are plain tensors. ``kvlocal verify`` checks it against llama.cpp.

Trade-offs, honestly: weights are held dequantized (4 bytes a parameter — ~0.55 GB for SmolLM2-135M)
and the cache grows by concatenation, so this is a measuring instrument, not an inference engine. One
sequence, no batch dimension: tensors are ``[T, ...]`` or ``[H, T, d]``.

The four architectures differ only in a few places, each marked where it happens (llama.cpp's
src/models/<arch>.cpp): q/k/v biases (qwen2), per-head q/k RMS norms before RoPE (qwen3, gemma3), and for
gemma3 scaled embeddings, norms after attention and FFN, a GELU gate, and sliding-window layers with
their own RoPE base. Which applies is decided from the file in :mod:`.weights`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvlocal.reference.cache import KVCache, LayerKV, attend
from kvlocal.reference.weights import ModelArgs, load_gguf

__all__ = ["ModelArgs", "Transformer", "RMSNorm", "Attention", "FeedForward", "rope_angles", "apply_rope", "prefill",
           "attend_window"]


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    """``x @ W.T + b`` with given weights (nn.Linear would first fill them with random numbers)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = _param(weight)  # [out, in]
        self.bias = _param(bias)  # [out] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = _param(weight)  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# -- RoPE ----------------------------------------------------------------------------------------


def rope_angles(positions: torch.Tensor, args: ModelArgs, freq_factors: torch.Tensor | None = None,
                base: float | None = None, scale: float | None = None):
    """cos and sin of the rotation angles, each [T, n_rot/2].

    Pair i turns by ``pos · base^(-2i/n_rot) / scale / freq_factor[i]`` — llama.cpp's
    ``theta_base · freq_scale / ff`` with ``freq_scale = 1/scale`` (no YaRN). Angles are formed in
    float64 (llama.cpp accumulates them in float32; the difference is below 1e-5 rad at 8K positions).
    base and scale default to the model's (``args.rope_base``, ``args.rope_scale``).
    """
    base = args.rope_base if base is None else base
    scale = args.rope_scale if scale is None else scale
    inv_freq = base ** (-torch.arange(0, args.n_rot, 2, dtype=torch.float64) / args.n_rot)  # [n_rot/2]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :] / scale  # [T, n_rot/2]
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str) -> torch.Tensor:
    """Rotate x: [H, T, d] by angles [T, n_rot/2]; dimensions past n_rot pass through.

    "norm" (llama): pairs are adjacent, (x[2i], x[2i+1]).  "neox" (qwen2): pairs are (x[i], x[i+n_rot/2]).
    """
    n_rot = 2 * cos.shape[-1]
    xr, rest = x[..., :n_rot], x[..., n_rot:]
    if rope_type == "norm":
        x0, x1 = xr[..., 0::2], xr[..., 1::2]  # [H, T, n_rot/2] each
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    elif rope_type == "neox":
        x0, x1 = xr[..., : n_rot // 2], xr[..., n_rot // 2 :]
        out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        raise ValueError(f"unknown rope type {rope_type!r}")
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


# -- blocks --------------------------------------------------------------------------------------


def attend_window(q: torch.Tensor, q_pos: torch.Tensor, kv: LayerKV, n_swa: int) -> torch.Tensor:
    """:func:`attend` for a sliding-window layer (n_swa > 0; 0 is plain :func:`attend`).

    llama.cpp (``is_masked_swa``, LLAMA_SWA_TYPE_STANDARD) hides a key at position p from a query at
    position P when ``P - p >= n_swa``, over whatever the cache holds. attend() masks whole slots, through
    their bias, so once the window cuts off a held slot the queries go one at a time, each with the
    slots outside its window hidden (a ``window`` argument of attend() would do this in one call).
    """
    if n_swa <= 0:
        return attend(q, q_pos, kv)
    hidden = (q_pos[:, None, None] - kv.pos[None] >= n_swa) & (kv.pos[None] >= 0)  # [T, Hkv, S]
    if not hidden.any():  # the window cuts nothing the cache holds
        return attend(q, q_pos, kv)
    out = [attend(q[:, t : t + 1], q_pos[t : t + 1],
                  dataclasses.replace(kv, bias=kv.bias.masked_fill(hidden[t], -math.inf)))
           for t in range(q.shape[1])]
    return torch.cat(out, dim=1)  # [Hq, T, d]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, w: dict[str, torch.Tensor], prefix: str, sliding: bool = False):
        super().__init__()
        self.args = args
        q_dim, kv_dim = args.n_head * args.head_dim, args.n_head_kv * args.head_dim
        if prefix + "attn_qkv.weight" in w:  # fused projection: rows are q, then k, then v
            wq, wk, wv = w[prefix + "attn_qkv.weight"].split([q_dim, kv_dim, kv_dim])
            b = w.get(prefix + "attn_qkv.bias")
            bq, bk, bv = b.split([q_dim, kv_dim, kv_dim]) if b is not None else (None, None, None)
        else:
            wq, wk, wv = (w[prefix + f"attn_{x}.weight"] for x in "qkv")
            bq, bk, bv = (w.get(prefix + f"attn_{x}.bias") for x in "qkv")  # qwen2 has q/k/v biases
        self.wq, self.wk, self.wv = Linear(wq, bq), Linear(wk, bk), Linear(wv, bv)
        self.wo = Linear(w[prefix + "attn_output.weight"], w.get(prefix + "attn_output.bias"))
        # qwen3, gemma3: RMSNorm over each head's d values of q and k, before RoPE
        self.q_norm = _norm(w, prefix + "attn_q_norm.weight", args.norm_eps)
        self.k_norm = _norm(w, prefix + "attn_k_norm.weight", args.norm_eps)
        self.sliding_window = args.n_swa if sliding else 0  # gemma3's sliding layers
        # attend() scales by 1/sqrt(d); the model's scale (gemma3: multiplies q after RoPE, then softmax
        # with scale 1) is folded into q before it
        gain = args.attn_scale * math.sqrt(args.head_dim)
        self.q_gain = 1.0 if math.isclose(gain, 1.0, rel_tol=1e-12) else gain

    def forward(self, x, positions, cos, sin, kv: LayerKV, queries: list | None = None):
        a, T = self.args, x.shape[0]  # x: [T, D]
        q = self.wq(x).view(T, a.n_head, a.head_dim).transpose(0, 1)  # [Hq, T, d]
        k = self.wk(x).view(T, a.n_head_kv, a.head_dim).transpose(0, 1)  # [Hkv, T, d]
        v = self.wv(x).view(T, a.n_head_kv, a.head_dim).transpose(0, 1)  # [Hkv, T, d]
        q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin, a.rope_type)
        k = apply_rope(k, cos, sin, a.rope_type)
        if queries is not None:
            queries.append(q)  # post-RoPE, llama.cpp's Qcur-<layer> ROPE node
        kv.append(k, v, positions)  # the new tokens see themselves through the cache
        if self.q_gain != 1.0:
            q = q * self.q_gain
        out = attend_window(q, positions, kv, self.sliding_window)  # [Hq, T, d]
        return self.wo(out.transpose(0, 1).reshape(T, a.n_head * a.head_dim))  # [T, D]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


class FeedForward(nn.Module):
    """Gated FFN: down(act(gate(x)) * up(x)) — SwiGLU (silu), or GeGLU with tanh GELU (gemma3)."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, act: str = "silu"):
        super().__init__()
        self.gate = Linear(w[prefix + "ffn_gate.weight"], w.get(prefix + "ffn_gate.bias"))  # [F, D]
        self.up = Linear(w[prefix + "ffn_up.weight"], w.get(prefix + "ffn_up.bias"))  # [F, D]
        self.down = Linear(w[prefix + "ffn_down.weight"], w.get(prefix + "ffn_down.bias"))  # [D, F]
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.down(self.act(self.gate(x)) * self.up(x))


def _norm(w: dict[str, torch.Tensor], name: str, eps: float) -> nn.Module:
    """RMSNorm with the file's weight, or the identity where the architecture has no such norm."""
    return RMSNorm(w[name], eps) if name in w else nn.Identity()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, w: dict[str, torch.Tensor], il: int):
        super().__init__()
        p = f"blk.{il}."
        self.attention_norm = RMSNorm(w[p + "attn_norm.weight"], args.norm_eps)
        self.attention = Attention(args, w, p, sliding=args.swa[il])
        self.post_attention_norm = _norm(w, p + "post_attention_norm.weight", args.norm_eps)  # gemma3
        self.ffn_norm = RMSNorm(w[p + "ffn_norm.weight"], args.norm_eps)
        self.feed_forward = FeedForward(w, p, args.ffn_act)
        self.post_ffw_norm = _norm(w, p + "post_ffw_norm.weight", args.norm_eps)  # gemma3

    def forward(self, x, positions, cos, sin, kv: LayerKV, queries: list | None = None):
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), positions, cos, sin, kv, queries))
        return h + self.post_ffw_norm(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, w: dict[str, torch.Tensor]):
        super().__init__()
        if not args.swa:
            args = dataclasses.replace(args, swa=(False,) * args.n_layer)
        self.args = args
        self.tok_embeddings = _param(w["token_embd.weight"])  # [V, D]
        self.layers = nn.ModuleList(TransformerBlock(args, w, il) for il in range(args.n_layer))
        self.norm = RMSNorm(w["output_norm.weight"], args.norm_eps)
        out_w = w.get("output.weight", w["token_embd.weight"])  # tied embeddings: no output.weight
        self.output = Linear(out_w, w.get("output.bias"))  # [V, D]
        self.rope_freqs = w.get("rope_freqs.weight")  # [n_rot/2] llama-3 frequency factors, or None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Transformer":
        """Load and dequantize every weight of a GGUF file once (seconds for a 135M model)."""
        args, weights = load_gguf(path)
        return cls(args, weights).eval()

    def new_cache(self) -> KVCache:
        """An empty cache shaped for this model."""
        return KVCache(self.args.n_layer, self.args.n_head_kv, self.args.head_dim)

    @torch.no_grad()  # not inference_mode: compression edits cache tensors in place afterwards
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, capture_queries: bool = False):
        """Run T new tokens at the given positions against what ``cache`` holds, appending their
        post-RoPE keys and values to it.

        tokens, positions: LongTensor [T]. Returns logits [T, V] (float32), or, with
        ``capture_queries=True``, ``(logits, queries)`` where ``queries[il]`` is layer il's post-RoPE
        queries [Hq, T, d] (before any attention scale).
        """
        a = self.args
        positions = positions.to(torch.int64)
        rope = {False: rope_angles(positions, a, self.rope_freqs)}  # (cos, sin), each [T, n_rot/2]
        if any(a.swa):  # gemma3's sliding layers: their own base, no scaling
            rope[True] = rope_angles(positions, a, base=a.rope_base_swa, scale=1.0)
        queries = [] if capture_queries else None
        x = self.tok_embeddings[tokens]  # [T, D]
        if a.embed_scale != 1.0:
            x = x * a.embed_scale  # gemma3: sqrt(n_embd)
        for il, layer in enumerate(self.layers):
            x = layer(x, positions, *rope[a.swa[il]], cache[il], queries)
        logits = self.output(self.norm(x))  # [T, V]
        if a.logit_softcap > 0:
            logits = a.logit_softcap * torch.tanh(logits / a.logit_softcap)
        return (logits, queries) if capture_queries else logits


def prefill(model: Transformer, tokens, cache: KVCache | None = None, start: int | None = None,
            chunk: int = 512) -> torch.Tensor:
    """Feed tokens at consecutive positions (from ``start``, default the cache's next position) in chunks
    of ``chunk`` tokens — attention memory stays [Hq, chunk, S] — and return logits [T, V]."""
    cache = model.new_cache() if cache is None else cache
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    start = cache.next_pos() if start is None else start
    out = []
    for c0 in range(0, len(tokens), chunk):
        piece = tokens[c0 : c0 + chunk]
        out.append(model(piece, torch.arange(start + c0, start + c0 + len(piece)), cache))
    return torch.cat(out) if out else torch.zeros(0, model.args.n_vocab)
