"""Tool calls (kvlocal/chat/toolcalls.py): the parsers on the text families write, and the whole path on the real
Qwen2.5-Coder-0.5B — its own Jinja template renders the tools, the calls come out of its reply, a tool's
result continues the cached conversation — through kvlocal.Chat, the OpenAI and Ollama clients on
`kvlocal serve` (in process) and kvlocal.Llama. SmolLM2's template takes no tools: a 400 that says so."""

from __future__ import annotations

import json

import pytest

from kvlocal.chat.toolcalls import CallFilter, check_tools, parse
from kvlocal.runtime.chat_template import tool_format
from kvlocal.errors import UsageError
from policy import need
from serving import in_process_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Lisbon today?"}]
RESULT = json.dumps({"city": "Lisbon", "temperature_c": 21, "sky": "sunny"})


def streamed(text: str, fmt: str, names=None, step: int = 1) -> tuple[str, list[dict]]:
    """(content, calls) of ``text`` fed to a CallFilter ``step`` characters at a time."""
    f = CallFilter(fmt, names)
    out = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step)) + f.finish()
    return out, f.calls


def functions(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def asks_lisbon(calls) -> bool:
    """One call of get_weather for Lisbon (the model may write the city's Portuguese name)."""
    return [(n, a.get("city")) for n, a in functions(calls)] in ([("get_weather", "Lisbon")], [("get_weather", "Lisboa")])


# -- the parsers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, fmt, content, calls", [
    # Qwen / Hermes: tagged calls, text around them is content, the line breaks between calls are not
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', "hermes",
     "Let me look.\n", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    # the end of the turn closes an open call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "hermes", "", [("get_weather", {"city": "Oslo"})]),
    # what is not JSON stays content, as written
    ("<tool_call>\nweather please\n</tool_call> ok", "hermes", "<tool_call>\nweather please\n</tool_call> ok", []),
    # bare and fenced call objects naming a tool (small models leave the tags out); other JSON is content
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', "hermes", "", [("get_weather", {"city": "Oslo"})]),
    ('```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n```', "hermes", "",
     [("get_weather", {"city": "Oslo"})]),
    ('{"name": "rm_rf", "arguments": {}}', "hermes", '{"name": "rm_rf", "arguments": {}}', []),
    ('{"answer": 42}', "hermes", '{"answer": 42}', []),
    # Llama 3.x: the reply is the call(s), parameters as the template names them
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Bergen}"}}; {"name": "get_time", "parameters": {}}',
     "llama3", "", [("get_weather", {"city": "Oslo; Bergen}"}), ("get_time", {})]),
    ("It is sunny in {city}.", "llama3", "It is sunny in {city}.", []),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}} and more', "llama3",
     '{"name": "get_weather", "parameters": {"city": "Oslo"}} and more', []),
])
def test_calls_come_out_of_the_text_streamed_or_whole(text, fmt, content, calls):
    names = {"get_weather", "get_time"}
    whole = parse(text, fmt, names)
    assert (whole[0], functions(whole[1])) == (content, calls)
    for step in (1, 3, 7):  # any split of the stream gives the same
        got = streamed(text, fmt, names, step)
        assert (got[0], functions(got[1])) == (content, calls), step
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole[1])


def test_the_template_decides_whether_tools_are_taken(qwen_model, smollm2_model, gemma3_model):
    assert qwen_model.tool_format == "hermes"
    assert smollm2_model.tool_format is None and gemma3_model.tool_format is None
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    llama3 = ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
              "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}{% endfor %}")
    assert tool_format(llama3) == "llama3"
    prompt = qwen_model.chat_prompt(QUESTION, tools=TOOLS)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt  # the model's own words for tools
    with pytest.raises(UsageError, match="does not take tools"):
        smollm2_model.chat_prompt(QUESTION, tools=TOOLS)


@pytest.mark.parametrize("tools, fragment", [
    ([], "non-empty list"),
    ([{"type": "function"}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {}},
                                                                     "required": ["b"]}}}], "required"),
    ([TOOLS[0], TOOLS[0]], "defined twice"),
])
def test_malformed_tool_schemas_are_refused(tools, fragment):
    with pytest.raises(UsageError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_tools(tools)


# -- kvlocal.Chat on Qwen2.5-Coder-0.5B ----------------------------------------------------------------------
@pytest.mark.slow(5)
def test_chat_with_tools_pins_them_and_continues_with_the_result(qwen_model, tmp_path):
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    with Chat(qwen_model, sampler=Sampler(), budget=0.1, ctx_size=4096, tools=TOOLS) as chat:  # greedy
        text = "".join(chat.send(QUESTION[0]["content"], max_tokens=64))
        assert text == "" and asks_lisbon(chat.tool_calls), chat.tool_calls
        s = chat.stats
        tools_tokens = len(qwen_model.tokenize(json.dumps(TOOLS[0]), add_special=False))
        assert s.kv_cells_pinned > tools_tokens  # the template's system part with the tools is never evicted
        call = chat.tool_calls[0]
        assert chat.messages[-1] == {"role": "assistant", "content": "", "tool_calls": [call]}
        p0 = chat.engine.stats.prompt_tokens
        reply = "".join(chat.send({"role": "tool", "tool_call_id": call["id"], "content": RESULT}, max_tokens=48))
        read = chat.engine.stats.prompt_tokens - p0
        print(f"after the result: {reply!r} {functions(chat.tool_calls)} ({read} tokens read)")
        assert read < 60  # only the tool turn was read: the conversation so far stayed in the cache
        assert chat.messages[-2]["role"] == "tool" and chat.messages[-1]["role"] == "assistant"
        # a reply that has to be a call: "required", and a named tool
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            "".join(chat.send("Thanks! And in Porto?", max_tokens=48, tool_choice=choice))
            assert [n for n, _ in functions(chat.tool_calls)] == ["get_weather"]
        chat.save(tmp_path / "tools.kvl")  # a saved session keeps the tools and the calls
        with Chat.load(tmp_path / "tools.kvl", qwen_model) as loaded:
            assert loaded.tools == chat.tools and loaded.messages == chat.messages
        with pytest.raises(UsageError, match="not one of the tools"):
            "".join(chat.send("x", tool_choice={"type": "function", "function": {"name": "nope"}}))


def test_a_chat_whose_template_takes_no_tools_refuses_them(smollm2_model):
    from kvlocal import Chat

    with pytest.raises(UsageError, match="does not take tools"):
        Chat(smollm2_model, budget=256, tools=TOOLS)


# -- the server: the OpenAI and Ollama clients --------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_server(qwen_model):
    with in_process_server(qwen_model, "qwen", max_tokens=64, budget="0.1", ctx_size=4096) as served:
        yield served


@pytest.mark.slow(7)
def test_openai_client_tool_round_trip(qwen_server):
    """call -> the tool's result -> the next reply, non-streamed and streamed: the same call, the result read
    into the conversation's cached KV (only the tool turn is new)."""
    openai = need("openai")
    url, _ = qwen_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="qwen", messages=QUESTION, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and asks_lisbon([call.model_dump()])

    # streamed: the call comes as a delta with its index, id, name and arguments
    deltas = [c.choices[0] for c in client.chat.completions.create(model="qwen", messages=QUESTION, tools=TOOLS,
                                                                    temperature=0, stream=True)]
    streamed_calls = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [t.index for t in streamed_calls] == [0] and asks_lisbon([t.model_dump() for t in streamed_calls])
    assert streamed_calls[0].id and deltas[-1].finish_reason == "tool_calls"

    follow = QUESTION + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model="qwen", messages=follow, tools=TOOLS, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            kv, usage = chunks[-1].model_extra["kv"], chunks[-1].usage
        else:
            r2 = client.chat.completions.create(model="qwen", messages=follow, tools=TOOLS, temperature=0)
            finish, kv, usage = r2.choices[0].finish_reason, r2.model_extra["kv"], r2.usage
            print(f"after the result: {r2.choices[0].message}")
        assert finish in ("stop", "tool_calls", "length")
        assert kv["cache_from"] == "memory" and kv["tokens_reused"] > 150, kv  # the conversation was continued...
        assert usage.prompt_tokens < 60  # ...reading only the tool turn


def test_bad_tool_requests_are_400s(qwen_server, smollm2_model):
    httpx = need("httpx")
    url, _ = qwen_server
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    asked = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    for body, param, fragment in [
        ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
        ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools", "JSON schema"),
        ({"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not one of the tools"),
        ({"messages": QUESTION, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": QUESTION + [{"role": "tool", "content": RESULT}], "tools": TOOLS}, "messages[1].role",
         "must answer the tool_calls"),
        ({"messages": asked + [{"role": "tool", "tool_call_id": "call_9", "content": RESULT}], "tools": TOOLS},
         "messages[2].tool_call_id", "not a call"),
        ({"messages": asked + [{"role": "user", "content": "hm"}], "tools": TOOLS}, "messages[2].role",
         "answered by tool messages"),
        ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": "{city"}}]}, {"role": "tool", "content": "x"}], "tools": TOOLS},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ]:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"], err
    with in_process_server(smollm2_model, "smollm2") as (small, _):
        r = httpx.post(small + "/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS}, timeout=60)
        assert r.status_code == 400 and "does not take tools" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "tools"


@pytest.mark.slow(6)
def test_ollama_client_tools(qwen_server):
    ollama = need("ollama")
    url, _ = qwen_server
    client = ollama.Client(host=url)
    r = client.chat(model="qwen", messages=QUESTION, tools=TOOLS, options={"temperature": 0})
    calls = r.message.tool_calls
    assert asks_lisbon([{"function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}} for c in calls])
    pieces = list(client.chat(model="qwen", messages=QUESTION, tools=TOOLS, options={"temperature": 0}, stream=True))
    streamed_calls = [c for p in pieces for c in p.message.tool_calls or []]
    assert [c.function.name for c in streamed_calls] == ["get_weather"] and pieces[-1].done
    follow = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": c.function.name, "arguments": dict(c.function.arguments)}} for c in calls]},
        {"role": "tool", "content": RESULT}]
    r2 = client.chat(model="qwen", messages=follow, tools=TOOLS, options={"temperature": 0})
    assert r2.done and r2.prompt_eval_count < 60  # the conversation's cache went on: only the tool turn was read


@pytest.mark.slow(7)
def test_llama_compat_tools(qwen):
    import kvlocal

    with kvlocal.Llama(qwen, n_ctx=4096, budget=0.1) as llm:
        r = llm.create_chat_completion(messages=QUESTION, tools=TOOLS, temperature=0)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert asks_lisbon(choice["message"]["tool_calls"])
        chunks = list(llm.create_chat_completion(messages=QUESTION, tools=TOOLS, temperature=0, stream=True))
        deltas = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
        assert [(t["index"], t["function"]["name"]) for t in deltas] == [(0, "get_weather")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        kept = lambda: [c for c, _ in llm._conversations.cache._items.values()]  # noqa: E731 - the one chat kept
        chat, = kept()
        call_id = choice["message"]["tool_calls"][0]["id"]  # ids are not what the model reads: the same conversation
        follow = QUESTION + [choice["message"], {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
        r2 = llm.create_chat_completion(messages=follow, tools=TOOLS, temperature=0, max_tokens=32)
        assert kept() == [chat] and r2["usage"]["prompt_tokens"] < 60  # the same chat: only the result read
