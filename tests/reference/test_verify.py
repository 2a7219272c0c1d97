"""``kvlocal verify``: passes when the reference matches llama.cpp, fails (exit 1) when it cannot."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kvlocal.cli import verify
from kvlocal.errors import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvlocal verify")
    verify.add_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


@pytest.fixture(autouse=True)
def passive_openmp(monkeypatch):
    """``verify.run`` asks for OMP_WAIT_POLICY=PASSIVE (torch's OpenMP beside ggml's, docs/verify.md): given for the
    test alone, so that it does not stay in this worker's environment for the CLI children started after it
    (PASSIVE decodes 2.2-2.7x slower, docs/engine.md)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")


def _run(*argv) -> int:
    return verify.run(_args(*argv, "--threads", 1))  # see conftest: one thread on a busy machine


def test_defaults():
    a = _args("m.gguf")
    assert (a.model, a.tokens, a.text, a.json, a.rope_freq_base) == ("m.gguf", 256, None, False, None)
    assert _args().model is None  # the default model, through kvlocal's model cache


@pytest.mark.parametrize("arch,wtype", [("llama", "Q4_0"), ("qwen2", "F16"), ("qwen3", "Q8_0"), ("gemma3", "F32")])
def test_passes_and_reports(tiny_path, capsys, arch, wtype):
    assert _run(tiny_path(arch, wtype), "--tokens", 128) == 0
    out = capsys.readouterr()
    assert "PASS" in out.out and "top-1 agreement" in out.out and "KL" in out.out
    assert "verify:" in out.err  # progress lines go to stderr


def test_json(tiny_path, capsys):
    assert _run(tiny_path("qwen2", "Q8_0"), "--tokens", 100, "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] is True and r["failed_checks"] == []
    assert r["tokens"] == 100 and r["weight_type"] == "Q8_0" and r["weight_class"] == "quantized"
    for key in ("max_abs_diff", "mean_abs_diff", "top1_agreement", "mean_kl"):
        assert isinstance(r[key], float)


@pytest.mark.parametrize("arch,wtype,base", [("llama", "F32", 20000.0), ("qwen2", "Q4_0", 11000.0),
                                             ("gemma3", "Q8_0", 10000.0)])
def test_wrong_rope_base_fails(tiny_path, capsys, arch, wtype, base):
    """llama.cpp alone gets the override (the file says 10000, gemma3 1e6 — llama.cpp applies it to the
    full layers only): the check must fail with exit code 1."""
    assert _run(tiny_path(arch, wtype), "--tokens", 128, "--rope-freq-base", base, "--json") == 1
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] is False and "mean_kl" in r["failed_checks"]
    assert r["rope_freq_base"] == {"file": 1e6 if arch == "gemma3" else 10000.0, "llama_cpp": base}


def test_smollm2_passes_and_fails_with_wrong_rope_base(smollm2_ref, smollm2_llama, sample_text):
    """The real Q4_1 model passes; with llama.cpp's RoPE base at 10000 instead of 100000 it fails."""
    tokens = smollm2_llama.tokenize(sample_text)[:128]
    good = verify.compare_models(smollm2_ref, smollm2_llama, tokens, n_threads=1)
    assert good["passed"], good
    bad = verify.compare_models(smollm2_ref, smollm2_llama, tokens, rope_freq_base=10000.0, n_threads=1)
    assert not bad["passed"] and "mean_kl" in bad["failed_checks"], bad
    assert bad["mean_kl"] > 3 * good["tolerance"]["kl"], bad  # measured 0.085 against 0.02


@pytest.mark.slow(7)
def test_gemma3_passes_and_fails_with_wrong_rope_base(gemma3, sample_text):
    """Gemma 3 270M (Q4_K_M: Q8_0 embedding, Q5_0/Q4_K/Q6_K layers, sliding windows, 262K vocabulary)
    passes; with llama.cpp's full-layer RoPE base at 100 instead of 1e6 it fails (at 10000 it fails too, but
    by less: only 3 of 18 layers take the override, docs/verify.md)."""
    from kvlocal.reference import Transformer
    from kvlocal.runtime import Model

    ref, lm = Transformer.from_gguf(gemma3), Model(gemma3)
    tokens = lm.tokenize(sample_text)[:64]
    good = verify.compare_models(ref, lm, tokens)
    assert good["passed"] and good["arch"] == "gemma3", good  # measured mean KL 0.005 over 256 tokens
    bad = verify.compare_models(ref, lm, tokens, rope_freq_base=100.0)
    assert not bad["passed"] and bad["mean_kl"] > 3 * good["tolerance"]["kl"], bad


def test_short_text_is_repeated(tiny_path, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("The cat sat on the mat.", encoding="utf-8")
    assert _run(tiny_path("llama", "F32"), "--tokens", 150, "--text", text, "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens"] == 150 and r["text"] == str(text)


def test_bad_input(tiny_path, tmp_path):
    model = tiny_path("llama", "F32")
    with pytest.raises(UsageError, match="--tokens"):
        _run(model, "--tokens", 0)
    with pytest.raises(UsageError, match="--text"):
        _run(model, "--text", tmp_path / "missing.txt")
    with pytest.raises(UsageError, match="rope-freq-base"):
        _run(model, "--rope-freq-base", -1)
    with pytest.raises(UsageError, match="no such file"):
        _run(tmp_path / "missing.gguf")


def test_unsupported_type_is_a_usage_error(unsupported_gguf):
    with pytest.raises(UsageError, match="Q8_1"):
        _run(unsupported_gguf, "--tokens", 16)


def test_compare_logits():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 40)).astype(np.float32) * 3
    m = verify.compare_logits(a, a.copy())
    assert m["max_abs_diff"] == 0 and m["top1_agreement"] == 1 and abs(m["mean_kl"]) < 1e-12
    m = verify.compare_logits(a, a + 5.0)  # a constant shift changes no probability
    assert abs(m["mean_kl"]) < 1e-9 and m["top1_agreement"] == 1 and m["mean_abs_diff"] == pytest.approx(5.0)
    m = verify.compare_logits(a, rng.standard_normal((50, 40)).astype(np.float32) * 3)
    assert m["mean_kl"] > 1 and m["top1_agreement"] < 0.3


def test_weight_classes():
    assert verify.weight_class("Q4_1") == "quantized" and verify.weight_class("Q6_K") == "quantized"
    assert verify.weight_class("F16") == "F16" and verify.weight_class("BF16") == "BF16"
    assert verify.weight_class("Q2_K") == "low-bit"
    assert verify.weight_class("F32", "gemma3") == "F16"  # llama.cpp's fp16 GELU table
    assert verify.weight_class("F32", "qwen3") == "F32" and verify.weight_class("Q8_0", "gemma3") == "quantized"
    assert verify.TOLERANCES["F32"].kl < verify.TOLERANCES["F16"].kl < verify.TOLERANCES["quantized"].kl
