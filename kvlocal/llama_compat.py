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
again — the conversation core's lookup (:mod:`kvlocal.chat.conversation`), as ``kvlocal serve`` has it, so the
same conversation gives the same text, finish reason and usage here and from the server. ``tools`` and ``tool_choice`` go through the GGUF's own chat template, and the calls come back as
``message["tool_calls"]`` with ``finish_reason: "tool_calls"`` (streamed: one delta per call). What kvlocal
does not do (grammars, JSON mode, log probabilities, mirostat, ``functions``) raises
:class:`~kvlocal.errors.UsageError` naming it, instead of being ignored."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Iterator

from kvlocal.chat.conversation import Call, ConversationCache, Conversations, Turn
from kvlocal.engine.loops import LOOP_GUARD
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
        # the conversation core's lookup over one kept chat: a call that continues it reuses its cache
        self._conversations = Conversations(self._new_chat, ConversationCache(max_bytes=float("inf"), max_chats=1))

    def close(self) -> None:
        self._conversations.close()
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
        from kvlocal.chat.messages import normalize_messages
        from kvlocal.chat.toolcalls import check_tool_choice, check_tools
        from kvlocal.runtime import Sampler, SamplerParamError

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
        msgs = normalize_messages(messages)  # BadMessage (a UsageError) names the message at fault
        try:
            sampler = Sampler(temp=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                              seed=None if seed in (None, -1) else seed)
        except SamplerParamError as e:
            raise UsageError(f"{'temperature' if e.param == 'temp' else e.param} must be {e.rule} (got {e.value})") from None
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        call = Call(msgs, sampler, max_tokens if max_tokens and max_tokens > 0 else None, stops, tools=tools,
                    tool_choice=tool_choice if tools else "auto")
        turn = self._conversations.turn(call)
        cid, created, name = f"chatcmpl-{uuid.uuid4()}", int(time.time()), model or self.model_path
        if stream:
            return self._chunks(turn, cid, created, name)
        r = turn.run()
        message = {"role": "assistant", "content": r.text}
        if r.tool_calls:
            message.update(content=r.text or None, tool_calls=r.tool_calls)
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": r.finish_reason}],
                "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                          "total_tokens": r.prompt_tokens + r.completion_tokens}}

    @staticmethod
    def _chunks(turn: Turn, cid: str, created: int, model: str) -> Iterator[dict]:
        def chunk(delta: dict, reason=None) -> dict:
            return {"id": cid, "model": model, "created": created, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        yield chunk({"role": "assistant"})
        try:
            for piece in turn:
                yield chunk({"content": piece})
        finally:  # a reader that stops early: the reply so far is kept with the chat
            turn.close()
        for index, call in enumerate(turn.result.tool_calls):  # each call as one delta
            yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, turn.result.finish_reason)

    def _new_chat(self, call: Call):
        """A chat for a call that continues none kept: the settings, the call's system message and tools."""
        from kvlocal.chat import Chat

        return Chat(self.model, settings=dataclasses.replace(self._settings, system=call.system), tools=call.tools,
                    runtime=self._runtime)
