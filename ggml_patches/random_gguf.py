#!/usr/bin/env python3
"""Write a GGUF file of a real model's shape with random Q4_0 weights, for speed and memory checks.

    python ggml_patches/random_gguf.py OUT.gguf                  # Llama-3-8B's shape (4.3 GiB)
    python ggml_patches/random_gguf.py OUT.gguf --shape tiny     # a few MiB, to try the pipeline

Speed does not depend on the weights' values, only on the shapes and the type, so a random file stands
in for a model that cannot be downloaded on an offline GPU machine (ggml_patches/gpu_check.sh). One random
buffer per distinct tensor shape is shared by every layer: writing 8B takes seconds. Q4_0 blocks get a
small fixed scale so activations stay finite through the RMS norms. The vocabulary is gpt2-style byte
tokens padded with unused ones up to the shape's n_vocab (the output layer keeps its real size).
Needs numpy and gguf.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

SHAPES = {
    # Llama-3-8B: GQA 32 query heads over 8 KV heads, head size 128
    "llama3-8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, rope_base=500000.0),
    # Llama-3-8B's attention (its KV cache and attn_output per layer) in two layers, a small FFN and vocabulary:
    # the native backend's graphs at the real per-layer size, in a file of ~60 MiB (tests/backends/test_native_scale.py)
    "llama3-8b-attn": dict(n_embd=4096, n_layer=2, n_head=32, n_head_kv=8, n_ff=1024, n_vocab=1024, rope_base=500000.0),
    "tiny": dict(n_embd=256, n_layer=4, n_head=8, n_head_kv=2, n_ff=512, n_vocab=1024, rope_base=10000.0),
}
CTX_TRAIN = 131072


def q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 rows as raw bytes [rows, cols/32*18]: an f16 scale then 16 bytes of nibbles per block."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_0]
    n_blocks = cols // block
    data = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)
    scale = np.float16(1.0 / (8 * np.sqrt(cols)))  # nibbles in [-8, 7]: outputs of std ~0.6 for unit inputs
    data[:, :, :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return data.reshape(rows, n_blocks * size)


def write(path: str, shape: str, seed: int = 0) -> None:
    import gguf

    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    d, hd = s["n_embd"], s["n_embd"] // s["n_head"]
    wr = gguf.GGUFWriter(path, "llama")
    wr.add_name(f"random-{shape}")
    wr.add_context_length(CTX_TRAIN)
    wr.add_embedding_length(d)
    wr.add_block_count(s["n_layer"])
    wr.add_feed_forward_length(s["n_ff"])
    wr.add_head_count(s["n_head"])
    wr.add_head_count_kv(s["n_head_kv"])
    wr.add_rope_dimension_count(hd)
    wr.add_rope_freq_base(s["rope_base"])
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(s["n_vocab"])
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    # GPT-2's byte-level tokens (every byte a printable character), one merge, unused padding, the end token
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    byte_tokens = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens = byte_tokens + ["th"] + [f"<unused_{i}>" for i in range(s["n_vocab"] - 258)] + ["<|end|>"]
    types = [int(gguf.TokenType.NORMAL)] * 257 + [int(gguf.TokenType.UNUSED)] * (s["n_vocab"] - 258) \
        + [int(gguf.TokenType.CONTROL)]
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(["t h"])
    wr.add_bos_token_id(s["n_vocab"] - 1)
    wr.add_eos_token_id(s["n_vocab"] - 1)
    wr.add_add_bos_token(False)

    q4 = gguf.GGMLQuantizationType.Q4_0
    kv = s["n_head_kv"] * hd
    mats = {}  # one random buffer per shape, shared by the layers

    def mat(rows, cols):
        if (rows, cols) not in mats:
            mats[rows, cols] = q4_0(rows, cols, rng)
        return mats[rows, cols]

    ones = np.ones(d, dtype=np.float32)
    wr.add_tensor("token_embd.weight", mat(s["n_vocab"], d), raw_dtype=q4)
    for il in range(s["n_layer"]):
        b = f"blk.{il}."
        wr.add_tensor(b + "attn_norm.weight", ones)
        wr.add_tensor(b + "attn_q.weight", mat(d, d), raw_dtype=q4)
        wr.add_tensor(b + "attn_k.weight", mat(kv, d), raw_dtype=q4)
        wr.add_tensor(b + "attn_v.weight", mat(kv, d), raw_dtype=q4)
        wr.add_tensor(b + "attn_output.weight", mat(d, d), raw_dtype=q4)
        wr.add_tensor(b + "ffn_norm.weight", ones)
        wr.add_tensor(b + "ffn_gate.weight", mat(s["n_ff"], d), raw_dtype=q4)
        wr.add_tensor(b + "ffn_up.weight", mat(s["n_ff"], d), raw_dtype=q4)
        wr.add_tensor(b + "ffn_down.weight", mat(d, s["n_ff"]), raw_dtype=q4)
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", mat(s["n_vocab"], d), raw_dtype=q4)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("random_gguf.py: the gguf package is missing: pip install gguf", file=sys.stderr)
        return 2
    write(args.out, args.shape, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
