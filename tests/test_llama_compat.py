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
        chat = llm._chat
        c = llm.create_chat_completion(messages=follow, max_tokens=16, temperature=0, stop=["\n"])
        assert llm._chat is chat and c["usage"]["prompt_tokens"] < 20
        assert "Paris" in c["choices"][0]["message"]["content"] and "\n" not in c["choices"][0]["message"]["content"]

        for bad in (dict(tools=[{"type": "function", "function": {"name": "f"}}]), dict(grammar="root ::= x"),
                    dict(mirostat_mode=2), dict(temperature=-1.0), dict(messages=[])):
            with pytest.raises(UsageError):
                llm.create_chat_completion(**{"messages": GERMANY, **bad})
