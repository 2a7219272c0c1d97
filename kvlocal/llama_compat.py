"""``kvlocal.Llama``: llama-cpp-python's chat API on kvlocal, for apps that embed llama-cpp-python.

``create_chat_completion(messages=..., ...)`` takes llama-cpp-python's arguments and returns its shapes —
a ``chat.completion`` dict, or with ``stream=True`` an iterator of ``chat.completion.chunk`` dicts (the
role first, then the content, then the finish reason) — so switching is one import::

    from kvlocal import Llama          # was: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=32768, budget=0.1)
    llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}])

Underneath is one :class:`kvlocal.Chat`: the KV cache stays inside kvlocal's budget, the system message is
never evicted, and a call whose messages continue the previous call's conversation (its messages, then
the reply it got, then a new user message) reuses the compressed cache instead of reading everything
again. ``tools`` and ``tool_choice`` go through the GGUF's own chat template, and the calls come back as
``message["tool_calls"]`` with ``finish_reason: "tool_calls"`` (streamed: one delta per call). What kvlocal
does not do (grammars, JSON mode, log probabilities, mirostat, ``functions``) raises
:class:`~kvlocal.errors.UsageError` naming it, instead of being ignored."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Iterator

from kvlocal.engine.loops import LOOP_GUARD
from kvlocal.chat.stops import until_stop
from kvlocal.errors import UsageError


class Llama:
    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = 0, n_gpu_layers: int = 0,
                 n_threads: int | None = None, flash_attn: bool = False, verbose: bool = True,
                 rpc_servers: str | None = None, tensor_split=None,
                 budget: str | float | int = 0.1, method: str = "criticalkv", recall: bool | None = None,
                 loop_guard: int = LOOP_GUARD, **ignored):
        """``model_path``, ``n_ctx`` (0: the model's trained context; a ratio budget is a share of it),
        ``n_gpu_layers``, ``n_threads``, ``flash_attn``, ``rpc_servers`` (``"host:port,..."``), ``tensor_split`` as
        llama-cpp-python's; ``budget``, ``method``, ``recall``,
        ``loop_guard`` as :class:`kvlocal.Chat`'s (a reply the loop guard ends has ``finish_reason: "loop"``).
        Other llama-cpp-python arguments (``n_batch``, ``seed``, ...) are accepted and have no effect."""
        from kvlocal.models import resolve
        from kvlocal.settings import ChatSettings, RuntimeSettings

        # llama-cpp-python's names as kvlocal's settings, checked before the model loads
        self._settings = ChatSettings(budget=budget, method=method, ctx_size=n_ctx, flash_attn=flash_attn,
                                      recall=recall, loop_guard=loop_guard)
        self._runtime = RuntimeSettings(n_gpu_layers=n_gpu_layers, n_threads=n_threads, rpc=rpc_servers or (),
                                        tensor_split=tensor_split)
        self.model_path = str(resolve(os.fspath(model_path)))
        self.model = self._runtime.load(self.model_path)
        self.verbose = verbose
        self._chat = None

    def close(self) -> None:
        if self._chat is not None:
            self._chat.close()
            self._chat = None
        self.model.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create_chat_completion(self, messages, functions=None, function_call=None, tools=None, tool_choice=None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               typical_p: float = 1.0, stream: bool = False, stop=None, seed: int | None = None,
                               response_format=None, max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor=None, grammar=None, logit_bias=None,
                               logprobs=None, top_logprobs=None):
        """llama-cpp-python's ``Llama.create_chat_completion``: see the module docstring."""
        from kvlocal.runtime import Sampler, SamplerParamError
        from kvlocal.server.requests import BadRequest, normalize_messages

        from kvlocal.chat.tools import check_tool_choice, check_tools, turn_start

        for name, value in (("functions", functions), ("function_call", function_call),
                            ("grammar", grammar), ("logits_processor", logits_processor), ("logit_bias", logit_bias),
                            ("logprobs", logprobs), ("top_logprobs", top_logprobs)):
            if value:
                raise UsageError(f"{name} is not supported by kvlocal.Llama" + ("; use tools" if "function" in name else ""))
        tools = check_tools(tools) if tools else None
        if check_tool_choice(tool_choice, tools) == "none":
            tools = None  # not in the prompt, as the server has it
        if response_format and (response_format or {}).get("type") != "text":
            raise UsageError("response_format: only {'type': 'text'} is supported by kvlocal.Llama")
        for name, value, neutral in (("typical_p", typical_p, 1.0), ("tfs_z", tfs_z, 1.0), ("mirostat_mode", mirostat_mode, 0),
                                     ("presence_penalty", presence_penalty, 0.0),
                                     ("frequency_penalty", frequency_penalty, 0.0)):
            if value != neutral:
                raise UsageError(f"{name} is not supported by kvlocal.Llama (leave it at {neutral}); repeat_penalty is")
        try:
            msgs = normalize_messages(messages)
            sampler = Sampler(temp=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                              seed=None if seed in (None, -1) else seed)
        except BadRequest as e:
            raise UsageError(str(e)) from None
        except SamplerParamError as e:
            raise UsageError(f"{'temperature' if e.param == 'temp' else e.param} must be {e.rule} (got {e.value})") from None
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        new = msgs[turn_start(msgs):]
        chat = self._chat_for(msgs[:len(msgs) - len(new)], tools)
        chat.sampler = sampler
        s0 = chat.engine.stats
        p0, g0 = s0.prompt_tokens, s0.generated_tokens
        limit = max_tokens if max_tokens and max_tokens > 0 else chat.settings.max_reply
        pieces = until_stop(chat.send(new, limit, tool_choice=tool_choice if tools else "auto"), stops)
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())

        def finish(stopped: bool) -> str:  # stopped: at a stop string
            reason = chat.finish_reason
            return "stop" if stopped and reason != "tool_calls" else reason or "stop"

        if stream:
            return self._chunks(pieces, cid, created, model or self.model_path, finish, chat)
        text, stopped = "", False
        while True:
            try:
                text += next(pieces)
            except StopIteration as e:
                stopped = bool(e.value)
                break
        s = chat.engine.stats
        prompt, completion = s.prompt_tokens - p0, s.generated_tokens - g0
        message = {"role": "assistant", "content": text}
        if chat.tool_calls:
            message.update(content=text if text.strip() else None, tool_calls=list(chat.tool_calls))
        return {"id": cid, "object": "chat.completion", "created": created, "model": model or self.model_path,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish(stopped)}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}

    @staticmethod
    def _chunks(pieces, cid: str, created: int, model: str, finish, chat) -> Iterator[dict]:
        def chunk(delta: dict, reason=None) -> dict:
            return {"id": cid, "model": model, "created": created, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        yield chunk({"role": "assistant"})
        while True:
            try:
                piece = next(pieces)
            except StopIteration as e:
                stopped = bool(e.value)
                break
            yield chunk({"content": piece})
        for index, call in enumerate(chat.tool_calls):  # each call as one delta
            yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, finish(stopped))

    def _chat_for(self, history: list[dict], tools: list[dict] | None):
        """The chat to answer in after ``history``: the current one when ``history`` is its conversation so far
        (with the same tools), else a new one that reads it (without generating)."""
        from kvlocal.chat import Chat
        from kvlocal.chat.tools import message_key

        c = self._chat
        if c is not None and c.tools == tools and [message_key(m) for m in c.messages] == [message_key(m) for m in history]:
            return c
        if c is not None:
            c.close()
            self._chat = None
        system = history[0]["content"] if history and history[0]["role"] == "system" else None
        chat = Chat(self.model, settings=dataclasses.replace(self._settings, system=system), tools=tools,
                    runtime=self._runtime)
        rest = [m for m in history if m["role"] != "system"]
        if rest:
            chat.extend(rest)
        self._chat = chat
        return chat
