"""Ordinary inference on kvlocal's patched llama.cpp against the stock build of the same source.

    python -m tools.bench_stock gemma3-270m --q4_0 smollm2-135m     # Q4_K attn_output, and a Q4_0 copy
    python -m tools.bench_stock MODEL ... --rounds 5 --tokens 2000 --decode 64 -t 2

Patch 0008 keeps every model's ``attn_output`` out of the CPU's repacked (interleaved) weight buffers, which
serve Q4_0, Q4_K and IQ4_NL matrices to faster GEMM kernels, so the patched runtime may be slower on those
types even with no compression at all. Each round runs ``kvlocal run MODEL --method full`` (the same prompt,
greedy) once on each runtime, in alternation, in fresh processes; the table gives the median prefill and
decode speeds and their ratio, patched over stock (1.00: as fast). The stock runtime is the one
``ggml_patches/build.py --stock DIR`` installs (the test suite's, by default). ``--q4_0 MODEL`` also measures a
Q4_0 copy of MODEL (every Q4_1 matrix re-quantized with gguf's quantizer; written once next to the model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def q4_0_copy(src: Path) -> Path:
    """A copy of a GGUF whose Q4_1 matrices are re-quantized to Q4_0 (metadata and other tensors as they are)."""
    import gguf
    from gguf.quants import dequantize, quantize

    dst = src.with_name(src.stem + ".requant-Q4_0.gguf")
    if dst.exists():
        return dst
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst) + ".part", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    Q = gguf.GGMLQuantizationType
    for t in reader.tensors:  # t.data: values, or a quantized tensor's bytes per row
        if t.tensor_type == Q.Q4_1:
            writer.add_tensor(t.name, quantize(dequantize(t.data, Q.Q4_1), Q.Q4_0), raw_dtype=Q.Q4_0)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".part", dst)
    return dst


def run_once(model: str, prompt: Path, decode: int, threads: int, stock: Path | None) -> dict:
    env = dict(os.environ)
    if stock is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(stock), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "kvlocal", "run", model, "--method", "full", "--prompt-file", str(prompt),
           "-n", str(decode), "--json", "-t", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    return {"prefill": out["prompt_tokens"] / out["prefill_seconds"], "decode": out["generated_tokens"] / out["decode_seconds"],
            "text": out["text"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["gemma3-270m"], help="known names or .gguf paths")
    ap.add_argument("--q4_0", nargs="*", default=[], metavar="MODEL", help="also measure a Q4_0 copy of these")
    ap.add_argument("--stock", type=Path, help="the stock runtime's folder (default: the test suite's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens (about)")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO / "ggml_patches"))
    from build import cache_dir

    from kvlocal.models import resolve
    from kvlocal.models.gguf_header import read_header

    stock = args.stock or cache_dir() / "stock-runtime"
    if not (stock / "llama_cpp").is_dir():
        sys.exit(f"no stock runtime in {stock}: run `python ggml_patches/build.py --stock {stock}`")
    prompt = Path(os.environ.get("TMPDIR", "/tmp")) / "kvlocal-bench-stock.txt"
    text = (REPO / "kvlocal/data/gpl-3.0.txt").read_text(encoding="utf-8")
    prompt.write_text(text[: args.tokens * 9 // 2], encoding="utf-8")  # ~4.5 characters a token
    models = [resolve(m) for m in args.models] + [q4_0_copy(resolve(m)) for m in args.q4_0]

    print(f"{args.rounds} rounds, ~{args.tokens}-token prompt, {args.decode} decoded, {args.threads} threads; "
          "tokens/s, median; ratio = patched / stock")
    print(f"{'model':44s} {'attn_output':>11s} {'prefill patched':>15s} {'stock':>7s} {'ratio':>6s} "
          f"{'decode patched':>14s} {'stock':>7s} {'ratio':>6s}  same text")
    for path in models:
        ao = {t.tensor_type.name for t in read_header(path).tensors if t.name.endswith("attn_output.weight")}
        got = {"patched": [], "stock": []}
        for _ in range(args.rounds):
            got["patched"].append(run_once(str(path), prompt, args.decode, args.threads, None))
            got["stock"].append(run_once(str(path), prompt, args.decode, args.threads, stock))
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("prefill", "decode")} for k, v in got.items()}
        same = all(a["text"] == b["text"] for a, b in zip(got["patched"], got["stock"]))
        p, s = med["patched"], med["stock"]
        print(f"{path.name[:44]:44s} {'/'.join(sorted(ao)):>11s} {p['prefill']:15.1f} {s['prefill']:7.1f} "
              f"{p['prefill'] / s['prefill']:6.2f} {p['decode']:14.1f} {s['decode']:7.1f} {p['decode'] / s['decode']:6.2f}  {same}")


if __name__ == "__main__":
    main()
