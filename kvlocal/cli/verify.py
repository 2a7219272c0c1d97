"""``kvlocal verify MODEL``: run the same tokens through llama.cpp and the PyTorch reference and compare.

The reference (``kvlocal.reference``) is what compression is measured against, so it must compute what
llama.cpp computes. This command shows it does, for a given file: it reports the largest and mean
absolute logit difference, top-1 agreement, and the mean KL divergence KL(llama.cpp ‖ reference) over
positions, and passes or fails against tolerances chosen per weight type (docs/verify.md has the table,
the measurements behind it and the reasoning).

llama.cpp runs with flash attention off and an F32 KV cache, so the comparison measures the weights
and the graph, not the precision of the cache. With ``--rope-freq-base X`` llama.cpp alone gets the
override while the reference keeps the file's value; the check must then fail — the proof that it can.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


from kvlocal.errors import UsageError
from kvlocal.eval.metrics import DECISIVE_MARGIN, compare_logits
from kvlocal.eval.tasks import sample_text

GGML_TYPE_F32 = 0  # ggml_type of an F32 KV cache


@dataclass(frozen=True)
class Tolerance:
    kl: float  # largest mean KL(llama.cpp ‖ reference), nats
    top1: float  # smallest top-1 agreement, fraction of positions
    decisive_top1: float  # smallest top-1 agreement at decisive positions


# By weight class. The reference uses float32 dequantized weights; llama.cpp's CPU matmuls round the
# activations to the weights' "vec_dot_type": F16 for F16, BF16 for BF16, 8-bit blocks (Q8_0/Q8_1/Q8_K)
# for every quantized type. That activation rounding dominates the difference: a model requantized to
# Q8_0 differs from the reference as much as the same model in Q4_0, so one tolerance covers 4- to 8-bit
# types. Values: the largest measurement in docs/verify.md times a margin of 3-10.
TOLERANCES = {
    "F32": Tolerance(kl=1e-6, top1=0.99, decisive_top1=1.0),
    "F16": Tolerance(kl=1e-4, top1=0.98, decisive_top1=1.0),
    "BF16": Tolerance(kl=3e-3, top1=0.95, decisive_top1=0.99),
    "quantized": Tolerance(kl=0.02, top1=0.90, decisive_top1=0.99),
    "low-bit": Tolerance(kl=0.05, top1=0.85, decisive_top1=0.98),  # not measured here: an extrapolation
}
WEIGHT_CLASSES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
for _t in ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4"):
    WEIGHT_CLASSES[_t] = "quantized"
# anything else (Q2_K, Q3_K, IQ1-IQ3, TQ*) is "low-bit"


# architectures whose llama.cpp CPU graph rounds activations to fp16 even with F32 weights: gemma3's GELU
# gate reads a table of fp16 values at the fp16-rounded input (ggml-cpu/vec.h, GGML_GELU_FP16)
FP16_ACTIVATIONS = {"gemma3"}


def weight_class(weight_type: str, arch: str | None = None) -> str:
    cls = WEIGHT_CLASSES.get(weight_type, "low-bit")
    return "F16" if cls == "F32" and arch in FP16_ACTIVATIONS else cls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a .gguf file (llama, qwen2, qwen3 or gemma3 architecture) or a known model name (default: qwen2.5-coder-0.5b)")
    parser.add_argument("--tokens", type=int, default=256, metavar="N", help="tokens to compare (default 256)")
    parser.add_argument("--text", type=Path, metavar="FILE",
                        help="UTF-8 text to use (default: built-in English prose; repeated if shorter than N tokens)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                        help="CPU threads for llama.cpp and torch (default: llama.cpp's default, torch's default)")
    parser.add_argument(
        "--rope-freq-base", type=float, metavar="X",
        help="give llama.cpp this RoPE base instead of the file's (the reference keeps the file's): must then fail",
    )


def _progress(msg: str) -> None:
    print(f"verify: {msg}", file=sys.stderr, flush=True)


def _model_path(model: str | None) -> Path:
    """A known model name (or None: the default model) through kvlocal's model cache; a path as it is
    (the reference loader checks the file and reads its header once — parsing a large vocabulary in
    gguf-py takes seconds)."""
    try:
        from kvlocal.models import KNOWN_MODELS, resolve
    except ImportError:
        KNOWN_MODELS, resolve = {}, None
    if resolve is not None and (model is None or model in KNOWN_MODELS):
        return Path(resolve(model))
    if model is None:
        raise UsageError("give the path of a .gguf model to verify")
    return Path(model)


def _tokens(model, text: str, n: int) -> list[int]:
    tokens = model.tokenize(text, add_special=True)
    if not tokens:
        raise UsageError("the text gives no tokens; pass a --text file with some prose in it")
    more = model.tokenize("\n\n" + text, add_special=False)
    while len(tokens) < n:  # a short text is repeated
        tokens += more
    return tokens[:n]


def run(args: argparse.Namespace) -> int:
    """Compare llama.cpp and the reference on one model; 0 = within tolerance, 1 = not."""
    # torch and ggml each bring an OpenMP runtime whose idle threads busy-wait by default; on a machine
    # with fewer free cores than threads that made both much slower (docs/verify.md § Time). Sleeping idle
    # threads cost nothing measurable. Effective only if neither library has started yet.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kvlocal.reference import Transformer  # torch: imported only by this command
    from kvlocal.runtime import Model

    if args.tokens < 1:
        raise UsageError(f"--tokens must be at least 1 (got {args.tokens})")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1 (got {threads})")
    if threads:
        import torch

        torch.set_num_threads(threads)
    if args.rope_freq_base is not None and not args.rope_freq_base > 0:
        raise UsageError(f"--rope-freq-base must be positive (got {args.rope_freq_base})")
    path = _model_path(args.model)
    if args.text is not None:
        try:
            text, source = Path(args.text).read_text(encoding="utf-8"), str(args.text)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --text {args.text}: {e}") from None
    else:
        text, source = sample_text(), "built-in sample text"

    t0 = time.perf_counter()
    _progress(f"loading and dequantizing {path.name} for the reference")
    ref_model = Transformer.from_gguf(path)  # checks the file (UsageError) before llama.cpp sees it
    t_load = time.perf_counter() - t0
    lm = Model(path)
    tokens = _tokens(lm, text, args.tokens)
    result = compare_models(ref_model, lm, tokens, args.rope_freq_base, n_threads=threads)
    result["text"] = source
    total = round(time.perf_counter() - t0, 2)
    result["seconds"] = {"reference_load": round(t_load, 2), **result["seconds"], "total": total}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_report(result))
    return 0 if result["passed"] else 1


def compare_models(ref_model, lm, tokens: list[int], rope_freq_base: float | None = None,
                   n_threads: int | None = None) -> dict:
    """Decode ``tokens`` at positions 0..T-1 with llama.cpp (``lm``, a runtime Model; optional RoPE-base
    override for llama.cpp only) and with the reference, and judge the difference. Returns the result
    dict that ``--json`` prints."""
    from kvlocal.reference import prefill
    from kvlocal.runtime import Context

    a, n = ref_model.args, len(tokens)
    _progress(f"llama.cpp: {n} tokens")
    t1 = time.perf_counter()
    # a sliding-window model's context must hold its window and a batch (runtime.Context says so)
    n_ctx = max(n, a.n_swa + min(n, 512)) if a.n_swa else n
    ctx = Context(lm, n_ctx=n_ctx, n_batch=min(n, 512), flash_attn=False, rope_freq_base=rope_freq_base or 0.0,
                  type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, n_threads=n_threads)
    try:
        ll = ctx.decode(tokens, positions=range(n), logits="all")  # [T, V]
    finally:
        ctx.close()
    t_llama = time.perf_counter() - t1

    _progress(f"reference: {n} tokens")
    t2 = time.perf_counter()
    ref = prefill(ref_model, tokens).numpy()  # [T, V]
    t_ref = time.perf_counter() - t2
    if ref.shape != ll.shape:
        raise UsageError(f"llama.cpp gives {ll.shape[1]} logits per token, the reference {ref.shape[1]}: "
                         "the vocabulary is padded differently")

    metrics = compare_logits(ll, ref)
    cls = weight_class(a.weight_type, a.arch)
    tol = TOLERANCES[cls]
    checks = {
        "mean_kl": metrics["mean_kl"] <= tol.kl,
        "top1_agreement": metrics["top1_agreement"] >= tol.top1,
        "decisive_top1_agreement": metrics["decisive_top1_agreement"] >= tol.decisive_top1,
    }
    return {
        "model": str(lm.path),
        "arch": a.arch,
        "n_layer": a.n_layer,
        "weight_type": a.weight_type,
        "file_type": a.file_type,
        "weight_class": cls,
        "tokens": n,
        "text": None,
        "rope_freq_base": {"file": a.rope_base, "llama_cpp": rope_freq_base or a.rope_base},
        **metrics,
        "tolerance": asdict(tol),
        "failed_checks": [k for k, ok in checks.items() if not ok],
        "passed": all(checks.values()),
        "seconds": {"llama_cpp": round(t_llama, 2), "reference": round(t_ref, 2)},
    }


def _report(r: dict) -> str:
    tol = r["tolerance"]
    lines = [
        f"{Path(r['model']).name}: {r['arch']}, {r['n_layer']} layers, weights {r['weight_type']} "
        f"(file type {r['file_type']}), {r['tokens']} tokens of {r['text']}",
    ]
    if r["rope_freq_base"]["llama_cpp"] != r["rope_freq_base"]["file"]:
        base = r["rope_freq_base"]
        lines.append(f"  llama.cpp runs with rope freq base {base['llama_cpp']:g}, "
                     f"the reference with the file's {base['file']:g}")
    lines += [
        f"  max |logit difference|     {r['max_abs_diff']:.4g}",
        f"  mean |logit difference|    {r['mean_abs_diff']:.4g}",
        f"  top-1 agreement            {100 * r['top1_agreement']:.2f}%   (tolerance >= {100 * tol['top1']:g}%)",
        f"  top-1 at decisive tokens   {100 * r['decisive_top1_agreement']:.2f}%   "
        f"of {r['decisive_positions']} with margin >= {DECISIVE_MARGIN:g}"
        f"   (tolerance >= {100 * tol['decisive_top1']:g}%)",
        f"  mean KL(llama.cpp||ref)    {r['mean_kl']:.3g} nats   "
        f"(tolerance <= {tol['kl']:g}, class {r['weight_class']})",
        f"  time: reference load {r['seconds']['reference_load']:.1f} s, llama.cpp {r['seconds']['llama_cpp']:.1f} s, "
        f"reference {r['seconds']['reference']:.1f} s",
    ]
    if r["passed"]:
        lines.append("PASS: the reference reproduces llama.cpp within tolerance")
    else:
        lines.append(f"FAIL: outside tolerance on {', '.join(r['failed_checks'])}")
    return "\n".join(lines)
