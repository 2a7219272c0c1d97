"""Tiny random-weight GGUF models that llama.cpp loads, for testing the reference against it offline.

Importable from anywhere in the repository (``from tests.reference.tiny_gguf import write_tiny``)::

    write_tiny(path, arch="llama", wtype="F32", seed=0, rope_base=None, rope_scaling=None,
               rope_freqs=False, n_swa=8, swa_pattern=3, rope_base_swa=10000.0, head_dim=None) -> Path

``arch``: ``"llama" | "qwen2" | "qwen3" | "gemma3"`` (:data:`ARCHS`); ``wtype``: ``"F32" | "F16" | "BF16" |
"Q8_0" | "Q4_0"`` (:data:`WTYPES`, the types gguf-py can write); ``rope_scaling``: ``(type, factor)``, e.g.
``("linear", 4.0)``; ``rope_base``: the file's RoPE base (default 10000, gemma3 1e6); ``rope_freqs`` (llama only): add a llama-3 style ``rope_freqs.weight`` (frequency
factors 1…32, see :func:`llama3_freq_factors`); ``n_swa``, ``swa_pattern``, ``rope_base_swa`` (gemma3
only): sliding window in tokens, every ``swa_pattern``-th layer full (0: none), the sliding layers' RoPE
base; ``head_dim``: another head size than the table's (written as ``attention.key_length``, e.g. 64 for a
quantized KV cache's whole 4-byte words). ``write_tiny_gguf`` is the same function (its old name). Shapes:

| arch | layers | n_embd | heads q/kv | head dim | FFN | output | extras |
|---|---|---|---|---|---|---|---|
| llama | 4 | 128 | 4/2 | 32 | SwiGLU 256 | own matrix | optional rope_freqs |
| qwen2 | 4 | 128 | 4/2 | 32 | SwiGLU 256 | tied | q/k/v biases |
| qwen3 | 4 | 128 | 4/2 | 48 (key_length ≠ n_embd/n_head) | SwiGLU 256 | tied | q/k norms |
| gemma3 | 6 | 128 | 4/2 | 64 | GeGLU 256 | tied | q/k norms, post norms, window 8 on layers 0,1,3,4 (pattern 3), full RoPE base 1e6, sliding 1e4 |

All use a byte-level BPE ("gpt2") vocabulary of 320: the 256 GPT-2 byte tokens, a few dozen merges and
one control token, so any text tokenizes.

Weight scales are chosen so the model is not degenerate: attention logits have a standard deviation
of a few units (attention is neither uniform nor one-hot), the residual stream grows over layers as in
trained models, and logits spread over several units, so top-1 and KL comparisons mean something.

Quantized files store every 2D weight in the given type, norms and biases in F32 — as llama-quantize
does. Run as a script to write all twenty into a folder, or with ``--requantize MODEL`` copies of a real
model in F32, F16, BF16, Q8_0 and Q4_0 (docs/verify.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
from gguf.quants import quantize

N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 4, 128, 4, 2, 32, 256
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
N_LAYERS = {"gemma3": 6}  # per architecture, else N_LAYER
HEAD_DIMS = {"qwen3": 48, "gemma3": 64}  # attention.key_length where it is not n_embd / n_head
TIED = ("qwen2", "qwen3", "gemma3")  # no output.weight
GEMMA_EMBD, GEMMA_POST_GAIN = 2.5, 4.0  # input rms, sublayer output rms: attention and FFN dominate
WTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "BF16": gguf.LlamaFileType.MOSTLY_BF16,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
# common English pairs, in merge order; each merge adds its joined token to the vocabulary
_MERGES = [
    "Ġ t", "h e", "i n", "e r", "a n", "o n", "Ġ a", "r e", "e n", "Ġt he", "Ġ s", "Ġ w", "Ġ o", "a t",
    "o r", "e d", "Ġ h", "i s", "Ġ b", "Ġ c", "i t", "e s", "Ġ f", "a r", "Ġ m", "o u", "Ġ p", "l l",
    "in g", "Ġ i", "a l", "l e", "Ġ d", "Ġt o", "Ġa n", "Ġo f", "Ġan d", "Ġ l", "Ġ n", "s t", "Ġ g",
    "o w", "v e", "Ġ e", "l y", "Ġ T", "Ġ I", "Ġ he", "Ġw h", "Ġ y", "i c", "o m", "a s", "i on",
    "Ġ u", "g h", "Ġ r", "c h", "Ġ H", "Ġ re", "s e", "l d", "i d",
]
EOS_TEXT = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what byte-level BPE vocabularies store)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte tokens, the merged tokens, then the EOS control token."""
    tokens = list(bytes_to_unicode().values())
    for m in _MERGES:
        joined = m.replace(" ", "")
        if joined not in tokens:
            tokens.append(joined)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens.append(EOS_TEXT)
    types.append(gguf.TokenType.CONTROL)
    return tokens, [int(t) for t in types], list(_MERGES)


def llama3_freq_factors(n_rot: int = HEAD_DIM, factor: float = 32.0, low: float = 1.0, high: float = 4.0,
                        old_ctx: int = 64, base: float = 10000.0) -> np.ndarray:
    """Llama 3's RoPE frequency factors as convert_hf_to_gguf computes them (``rope_freqs.weight``):
    1 for short wavelengths, ``factor`` for long ones, smooth between. A small ``old_ctx`` makes
    the scaled band fall inside a tiny model's head, so the factors matter within a few dozen tokens."""
    freqs = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    wavelen = 2 * np.pi / freqs
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    ff = np.where(wavelen < high_wavelen, 1.0,
                  np.where(wavelen > low_wavelen, factor, 1 / ((1 - smooth) / factor + smooth)))
    return ff.astype(np.float32)


def _weights(arch: str, n_vocab: int, seed: int, rope_freqs: bool = False, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Random weights in numpy order [out, in]; names as in GGUF."""
    rng = np.random.default_rng(seed)
    head_dim = head_dim or HEAD_DIMS.get(arch, HEAD_DIM)
    q_dim, kv_dim = N_HEAD * head_dim, N_HEAD_KV * head_dim
    qk_norms = arch in ("qwen3", "gemma3")

    def mat(n_out, n_in, gain):  # std gain/sqrt(n_in): outputs have std ~gain for unit-rms inputs
        return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

    def norm(n, gain=1.0):  # stored as llama.cpp multiplies (gemma's "1 +" already added, as the converter does)
        return (gain * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)}
    for il in range(N_LAYERS.get(arch, N_LAYER)):
        b = f"blk.{il}."
        w[b + "attn_norm.weight"] = norm(N_EMBD)
        # q·k/sqrt(d) then has std ~ gain² · sqrt(d) / sqrt(d) ≈ 2.5: peaked, not one-hot attention
        w[b + "attn_q.weight"] = mat(q_dim, N_EMBD, 1.6)
        w[b + "attn_k.weight"] = mat(kv_dim, N_EMBD, 1.6)
        w[b + "attn_v.weight"] = mat(kv_dim, N_EMBD, 1.0)
        if arch == "qwen2":
            for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                w[b + f"attn_{x}.bias"] = (0.3 * rng.standard_normal(n)).astype(np.float32)
        if qk_norms:  # q and k come out of their norms with rms ~1.6: the same attention logits
            w[b + "attn_q_norm.weight"] = norm(head_dim, 1.6)
            w[b + "attn_k_norm.weight"] = norm(head_dim, 1.6)
        w[b + "attn_output.weight"] = mat(N_EMBD, q_dim, 0.8)
        w[b + "ffn_norm.weight"] = norm(N_EMBD)
        w[b + "ffn_gate.weight"] = mat(N_FF, N_EMBD, 1.5)
        w[b + "ffn_up.weight"] = mat(N_FF, N_EMBD, 1.0)
        w[b + "ffn_down.weight"] = mat(N_EMBD, N_FF, 0.8)
        if arch == "gemma3":  # the sublayer outputs are normalized before the residual add
            w[b + "post_attention_norm.weight"] = norm(N_EMBD, GEMMA_POST_GAIN)
            w[b + "post_ffw_norm.weight"] = norm(N_EMBD, GEMMA_POST_GAIN)
    w["output_norm.weight"] = norm(N_EMBD)
    if arch not in TIED:
        w["output.weight"] = mat(n_vocab, N_EMBD, 4.0)  # logits with std ~4
    elif arch == "gemma3":  # tied, and scaled by sqrt(n_embd) at the input: rms GEMMA_EMBD there
        w["token_embd.weight"] *= GEMMA_EMBD / np.sqrt(N_EMBD)
    else:
        w["token_embd.weight"] *= 4.0 / np.sqrt(N_EMBD)  # tied: the same matrix gives logits with std ~4
    if rope_freqs:
        w["rope_freqs.weight"] = llama3_freq_factors(head_dim)
    return w


def write_tiny(path: str | Path, arch: str = "llama", wtype: str = "F32", seed: int = 0,
               rope_base: float | None = None, rope_scaling: tuple[str, float] | None = None,
               rope_freqs: bool = False, n_swa: int = 8, swa_pattern: int = 3,
               rope_base_swa: float = 10000.0, head_dim: int | None = None) -> Path:
    """Write one tiny model; returns the path (the module docstring has the parameters)."""
    if arch not in ARCHS or wtype not in WTYPES:
        raise ValueError(f"arch must be one of {ARCHS} and wtype one of {WTYPES}")
    if rope_freqs and arch != "llama":
        raise ValueError("rope_freqs: only llama's graph applies frequency factors")
    path = Path(path)
    tokens, types, merges = vocabulary()
    n_vocab = len(tokens)
    qtype = gguf.GGMLQuantizationType[wtype]
    head_dim = head_dim or HEAD_DIMS.get(arch, HEAD_DIM)

    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"tiny-{arch}-{wtype}")
    wr.add_context_length(2048)
    wr.add_embedding_length(N_EMBD)
    wr.add_block_count(N_LAYERS.get(arch, N_LAYER))
    wr.add_feed_forward_length(N_FF)
    wr.add_head_count(N_HEAD)
    wr.add_head_count_kv(N_HEAD_KV)
    if head_dim != N_EMBD // N_HEAD:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(head_dim)
    wr.add_rope_freq_base(rope_base or (1e6 if arch == "gemma3" else 10000.0))
    wr.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    if arch == "gemma3":
        wr.add_sliding_window(n_swa)
        wr.add_sliding_window_pattern(swa_pattern)
        wr.add_rope_freq_base_swa(rope_base_swa)
    if rope_scaling is not None:
        wr.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        wr.add_rope_scaling_factor(rope_scaling[1])
    wr.add_vocab_size(n_vocab)
    wr.add_file_type(FILE_TYPES[wtype])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(n_vocab - 1)
    wr.add_eos_token_id(n_vocab - 1)
    wr.add_add_bos_token(False)

    for name, arr in _weights(arch, n_vocab, seed, rope_freqs, head_dim).items():
        if arr.ndim == 2 and qtype == gguf.GGMLQuantizationType.F16:
            wr.add_tensor(name, arr.astype(np.float16))
        elif arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            wr.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
        else:
            wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


write_tiny_gguf = write_tiny  # the original name


def rewrite_gguf(src: str | Path, dst: str | Path, convert=None, extra: dict[str, np.ndarray] | None = None,
                 arch: str | None = None, meta: dict | None = None) -> Path:
    """Copy a GGUF file's metadata and tensors to ``dst``; ``convert(tensor) -> (data, raw_dtype) | None``
    may replace a tensor's stored data (None keeps it as it is), ``extra`` adds F32 tensors, ``arch``
    changes general.architecture (the other keys keep their names) and ``meta`` adds metadata keys
    (``{key: (value, gguf.GGUFValueType)}``)."""
    reader = gguf.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    wr = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        wr.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in (meta or {}).items():
        wr.add_key_value(key, value, vtype)
    for t in reader.tensors:
        new = convert(t) if convert else None
        if new is None:
            plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            new = (np.array(t.data), None if plain else t.tensor_type)
        data, raw = new
        wr.add_tensor(t.name, data, raw_dtype=raw)
    for name, arr in (extra or {}).items():
        wr.add_tensor(name, np.asarray(arr, dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return Path(dst)


def write_unsupported_gguf(path: str | Path, src: str | Path) -> Path:
    """A copy of model ``src`` whose first q projection is stored as Q8_1, a type gguf cannot dequantize."""
    q81 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q81]

    def convert(t):
        if t.name != "blk.0.attn_q.weight":
            return None
        n_out, n_in = (int(n) for n in reversed(t.shape))
        return np.zeros((n_out, n_in // block * size), dtype=np.uint8), q81

    return rewrite_gguf(src, path, convert)


def requantized_copy(src: str | Path, dst: str | Path, wtype: str = "F32") -> Path:
    """A copy of a real model with every 2D weight dequantized and stored again as ``wtype`` (F32, F16,
    BF16, Q8_0, Q4_0: the types gguf-py can write); 1D tensors as F32. general.file_type is left as it
    was: ``kvlocal verify`` judges by the dominant type of the 2D weights."""
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[wtype]

    def convert(t):
        shape = tuple(int(n) for n in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arr.ndim != 2 or wtype == "F32":
            return arr, None
        if wtype == "F16":
            return arr.astype(np.float16), None
        return quantize(arr, qtype), qtype

    return rewrite_gguf(src, dst, convert)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write the tiny test models, or requantized copies of a real model")
    ap.add_argument("out", type=Path, help="folder to write into")
    ap.add_argument("--requantize", type=Path, metavar="MODEL",
                    help="write F32/F16/BF16/Q8_0/Q4_0 copies of MODEL instead")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.requantize:
        for t in ("F32",) + WTYPES[1:]:
            print(requantized_copy(a.requantize, a.out / f"{a.requantize.stem}-{t}.gguf", t), flush=True)
    else:
        for arch in ARCHS:
            for t in WTYPES:
                print(write_tiny_gguf(a.out / f"tiny-{arch}-{t}.gguf", arch, t))
