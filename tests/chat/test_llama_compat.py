"""kvlocal.Llama: llama-cpp-python's create_chat_completion on kvlocal, checked against llama-cpp-python's
own output on the same model (SmolLM2): the same shapes, streamed and not; a follow-up reuses the cache."""

from __future__ import annotations

import pytest

import kvlocal
from kvlocal.errors import UsageError

GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]


def shape(x):
    """The structure of a reply: keys and value types, recursively (a list by its first element)."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    return type(x).__name__


def test_create_chat_completion_has_llama_cpp_pythons_shapes(smollm2):
    import llama_cpp

    ref = llama_cpp.Llama(model_path=str(smollm2), n_ctx=1024, verbose=False)
    with kvlocal.Llama(smollm2, n_ctx=1024, budget=256) as llm:
        a = ref.create_chat_completion(messages=GERMANY, max_tokens=16, temperature=0)
        b = llm.create_chat_completion(messages=GERMANY, max_tokens=16, temperature=0)
        assert shape(b) == shape(a) and b["object"] == a["object"] and b["model"] == a["model"]
        assert "Berlin" in b["choices"][0]["message"]["content"] and b["choices"][0]["finish_reason"] == "stop"
        assert b["usage"]["completion_tokens"] > 0 and b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]

        ra = list(ref.create_chat_completion(messages=GERMANY, max_tokens=4, temperature=0, stream=True))
        rb = list(llm.create_chat_completion(messages=GERMANY, max_tokens=4, temperature=0, stream=True))
        assert [shape(c) for c in rb] == [shape(c) for c in ra]  # role, content pieces, finish: one chunk each
        assert [c["choices"][0]["finish_reason"] for c in rb] == [c["choices"][0]["finish_reason"] for c in ra]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in rb) == \
            "".join(c["choices"][0]["delta"].get("content", "") for c in ra)  # greedy: the same tokens

        # a follow-up: the previous call's messages, its reply, a new question -> the same chat, only the new turn read
        follow = GERMANY + [{"role": "assistant", "content": "".join(c["choices"][0]["delta"].get("content", "") for c in rb)},
                            {"role": "user", "content": "And of France?"}]
        kept = lambda: [c for c, _ in llm._conversations.cache._items.values()]  # noqa: E731 - the one chat kept
        chat, = kept()
        c = llm.create_chat_completion(messages=follow, max_tokens=16, temperature=0, stop=["\n"])
        assert kept() == [chat] and c["usage"]["prompt_tokens"] < 20
        assert "Paris" in c["choices"][0]["message"]["content"] and "\n" not in c["choices"][0]["message"]["content"]

        for bad in (dict(tools=[{"type": "function", "function": {"name": "f"}}]), dict(grammar="root ::= x"),
                    dict(mirostat_mode=2), dict(temperature=-1.0), dict(messages=[])):
            with pytest.raises(UsageError):
                llm.create_chat_completion(**{"messages": GERMANY, **bad})


def test_llama_and_the_server_answer_a_conversation_alike(smollm2, smollm2_model):
    """Both doors call the one conversation core (kvlocal/chat/conversation.py): the same two turns, the second
    continuing the first (its cache reused by both), greedy, give the same text, finish reason and usage through
    kvlocal.Llama and through the server's OpenAI route."""
    import httpx

    from serving import in_process_server

    with kvlocal.Llama(smollm2, budget="256", n_threads=1) as llm, \
            in_process_server(smollm2_model, "smollm2-135m", budget="256") as (url, _):
        def both(messages: list[dict], **params) -> tuple[str, str, dict]:
            a = llm.create_chat_completion(messages=messages, temperature=0, **params)
            b = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "temperature": 0, **params},
                           timeout=300).json()
            got = [(r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"], r["usage"]) for r in (a, b)]
            assert got[0] == got[1]
            return got[0]

        text, finish, _ = both(GERMANY, max_tokens=24, stop=["."])  # a stop string: kept under the text the caller saw
        assert "Berlin" in text and finish == "stop"
        follow = GERMANY + [{"role": "assistant", "content": text}, {"role": "user", "content": "And of France?"}]
        _, finish, usage = both(follow, max_tokens=4)
        assert finish == "length" and usage["prompt_tokens"] < 20  # only the new turn read: the conversation continued


def test_kvlocal_llama_does_not_import_the_server(smollm2):
    """kvlocal.Llama answers without importing kvlocal.server (the HTTP layer), as tests/test_layers.py also
    holds its module to."""
    import subprocess
    import sys

    code = ("import sys, kvlocal\n"
            f"with kvlocal.Llama({str(smollm2)!r}, budget=256, n_threads=1) as llm:\n"
            "    r = llm.create_chat_completion(messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=2)\n"
            "print(r['usage']['completion_tokens'], sorted(m for m in sys.modules if m.startswith('kvlocal.server')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "[]"]
