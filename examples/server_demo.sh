#!/usr/bin/env bash
# kvlocal serve answering curl and the openai client (usage, kv), and a follow-up request timed with
# and without reuse of the conversation's compressed cache. docs/server.md quotes its output.
#   bash examples/server_demo.sh
cd "$(dirname "$0")/.."
LOG=$(mktemp)
.venv/bin/kvlocal serve smollm2-135m --budget 256 --port 8123 > "$LOG" 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -s http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
echo '$ curl http://127.0.0.1:8123/health'; curl -s http://127.0.0.1:8123/health; echo
echo '$ curl .../v1/chat/completions (non-streaming)'
curl -s http://127.0.0.1:8123/v1/chat/completions -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "What is the capital of Germany?"}], "max_tokens": 24}'; echo
echo '$ curl -N ... "stream": true'
curl -sN http://127.0.0.1:8123/v1/chat/completions -d '{"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 12, "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}'
echo '$ curl ... malformed JSON'; curl -s -w ' [HTTP %{http_code}]' http://127.0.0.1:8123/v1/chat/completions -d '{"messages": ['; echo
.venv/bin/python - <<'PY'
import time
from openai import OpenAI
c = OpenAI(base_url="http://127.0.0.1:8123/v1", api_key="none")
doc = open("kvlocal/data/gpl-3.0.txt").read()[:9000]
msgs = [{"role": "user", "content": doc + "\n\nWhat is this document?"}]
t = time.perf_counter(); r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24); t1 = time.perf_counter() - t
print("openai client, first request:", repr(r.choices[0].message.content), r.usage.model_dump(), r.model_extra["kv"], f"{t1:.2f} s")
msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Who publishes it?"}]
t = time.perf_counter(); r2 = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24); t2 = time.perf_counter() - t
print("follow-up, cache reused:", repr(r2.choices[0].message.content), r2.usage.model_dump(), r2.model_extra["kv"], f"{t2:.2f} s")
t = time.perf_counter(); r3 = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, extra_body={"cache_prompt": False}); t3 = time.perf_counter() - t
print("same follow-up, fresh (cache_prompt false):", repr(r3.choices[0].message.content), r3.usage.model_dump(), f"{t3:.2f} s")
print(f"follow-up: {t2:.2f} s with reuse vs {t3:.2f} s without ({t3 / t2:.0f}x)")
s = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, stream=True)
print("openai client, streamed:", "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices))
PY
kill -INT $SP; wait $SP; echo "server exit: $?"; cat "$LOG"
