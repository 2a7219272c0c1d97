"""tools/rpc_bytes.py's relay (docs/distributed.md: what crosses the network, and the time split): ggml-rpc's
frames cut out of a byte stream however it arrives, each answer matched to its request and its wait put on what
the server did first, and on loopback (one ``kvlocal rpc-server`` holding SmolLM2's last layers and its output) a
decoded token and a row copy costing the bytes the protocol says they do."""

from __future__ import annotations

import contextlib
import struct
import threading
from collections import Counter

import numpy as np
import pytest

from test_rpc import N_REMOTE, Servers, rpc_runtime
from tools.rpc_bytes import ANSWERED, COMMANDS, Conversation, Frames, Relay


@contextlib.contextmanager
def split_through_relay(smollm2):
    """SmolLM2 with its last layers and output on one rpc-server, behind a byte-counting relay: ``(model, relay,
    contexts)``; the contexts a test appends to ``contexts`` are closed before the model, then the relay and server."""
    rpc_runtime()
    from kvlocal.runtime import Model

    servers = Servers(1)
    relay = Relay(servers.endpoints[0])
    model, contexts = None, []
    try:
        model = Model(smollm2, n_gpu_layers=N_REMOTE, rpc=[relay.endpoint])
        yield model, relay, contexts
    finally:
        for ctx in contexts:
            ctx.close()
        if model is not None:
            model.close()
        relay.close()
        servers.stop()


def request(cmd: int, payload: bytes) -> bytes:
    return struct.pack("<BQ", cmd, len(payload)) + payload


def answer(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


# HELLO, SET_TENSOR, GRAPH_COMPUTE, GET_TENSOR, FREE_BUFFER (an empty payload), as ggml-rpc's client sends them
STREAM = request(14, bytes(4)) + request(6, bytes(1000)) + request(10, bytes(300)) + request(8, bytes(48)) + request(4, b"")


@pytest.mark.parametrize("cut", [1, 8, 9, 10, 1000, len(STREAM)])
def test_frames_are_cut_the_same_however_the_bytes_arrive(cut):
    frames = Frames(with_cmd=True)
    got = [f for i in range(0, len(STREAM), cut) for f in frames.feed(STREAM[i:i + cut])]
    assert got == [("HELLO", 13), ("SET_TENSOR", 1009), ("GRAPH_COMPUTE", 309), ("GET_TENSOR", 57), ("FREE_BUFFER", 9)]


def test_each_answer_is_matched_and_its_wait_goes_to_what_the_server_did_first():
    counts = Counter()
    talk = Conversation(counts, threading.Lock())
    talk.up(request(14, bytes(4)), 0.0)
    talk.down(answer(bytes(4)), 0.5)
    # a graph, then a read of its output: the read waits for the computation (answered in two pieces)
    talk.up(request(6, bytes(100)) + request(10, bytes(50)) + request(8, bytes(48)), 1.0)
    talk.down(answer(bytes(2000))[:10], 1.5)
    talk.down(answer(bytes(2000))[10:], 3.0)
    talk.up(request(8, bytes(48)), 4.0)  # a read alone: a transfer
    talk.down(answer(bytes(16)), 4.25)
    assert counts["round trips"] == 3 and not talk.pending
    assert (counts["wait HELLO"], counts["wait compute"], counts["wait GET_TENSOR"]) == (0.5, 2.0, 0.25)
    assert (counts["GET_TENSOR n"], counts["GET_TENSOR up"], counts["GET_TENSOR down"]) == (2, 114, 2032)
    assert counts["SET_TENSOR up"] == 109 and counts["GRAPH_COMPUTE up"] == 59 and not counts["GRAPH_COMPUTE down"]
    assert counts["up"] == sum(len(request(c, bytes(n))) for c, n in ((14, 4), (6, 100), (10, 50), (8, 48), (8, 48)))


@pytest.mark.slow(12)
def test_on_loopback_a_token_and_a_row_copy_cost_what_the_protocol_says(smollm2):
    """Through the relay: every byte each way belongs to a frame, every answered request is answered; a decoded token
    reads back only its logits (the output layer is on the server); a copy of ``n`` rows of a layer there, either way,
    moves their K and V and one int32 index per row for each, with flash attention (V untransposed, a row in one
    piece) and without it (llama.cpp stores V transposed: a row's V is kv_size elements apart, gathered on the
    device)."""
    from kvlocal.runtime import Context

    with split_through_relay(smollm2) as (model, relay, contexts):
        def since(before: Counter) -> Counter:
            c = relay.snapshot()
            c.subtract(before)
            return c

        a, n = model.arch, 100
        tokens = model.tokenize(" ".join(f"Locker {i} holds key {i * 37 % 1000}." for i in range(40)))[:200]
        for flash in (True, False):
            ctx = Context(model, 512, flash_attn=flash)
            contexts.append(ctx)
            ctx.decode(tokens)
            c0 = relay.snapshot()
            ctx.decode([tokens[0]])
            token = since(c0)
            c0 = relay.snapshot()
            k, v = ctx.get_rows(a.n_layer - 1, np.arange(n) % len(tokens), np.arange(n) % a.n_head_kv,
                                a.head_dim_k * 2, a.head_dim_v * 2)  # (F16)
            copy = since(c0)
            for c in (token, copy):
                assert sum(c[m + " up"] for m in COMMANDS.values()) == c["up"] > 0
                assert sum(c[m + " down"] for m in COMMANDS.values()) == c["down"] > 0
                assert c["round trips"] == sum(c[m + " n"] for m in ANSWERED)
            assert (token["GET_TENSOR n"], token["GET_TENSOR down"]) == (1, model.n_vocab * 4 + 8)  # (+ its size)
            assert (copy["GET_TENSOR n"], copy["GET_TENSOR down"]) == (2, k.nbytes + v.nbytes + 2 * 8)
            assert copy["SET_TENSOR n"] == 2 and 0 < copy["SET_TENSOR up"] - 4 * n * 2 < 2 * 1024  # (+ tensor headers)
            # the rows written back, then read again: nothing answers a write, so its last frames may still be on
            # their way when it returns; the read after it answers once they have all passed the relay
            c0 = relay.snapshot()
            ctx.set_rows(a.n_layer - 1, np.arange(n) % len(tokens), np.arange(n) % a.n_head_kv, k, v)
            again = ctx.get_rows(a.n_layer - 1, np.arange(n) % len(tokens), np.arange(n) % a.n_head_kv,
                                 a.head_dim_k * 2, a.head_dim_v * 2)
            both = since(c0)
            assert np.array_equal(again[0], k) and np.array_equal(again[1], v)
            # the write: the rows and two indices (a transposed V's go per KV head, each head's part of one index, as
            # it is read); the read: two indices up
            assert both["GET_TENSOR n"] == 2 and both["SET_TENSOR n"] == (4 if flash else 3 + a.n_head_kv) + 2
            assert 0 < both["SET_TENSOR up"] - (k.nbytes + v.nbytes + 2 * 4 * n * 2) < 4 * 1024  # (+ tensor headers)
            contexts.remove(ctx)
            ctx.close()


def test_a_decoded_token_sends_no_graph_while_the_capture_is_disarmed(smollm2):
    """kvlocal's contexts carry an eval callback (the query capture); llama.cpp reuses a token's graph from the last
    one, and with patch 0016 so does the scheduler's split, callback or not: a token whose queries nobody asked for
    sends GRAPH_RECOMPUTE (its uid), not the whole graph again — which was ~80% of a token's bytes. An armed token
    still sends its pieces."""
    from kvlocal.runtime import Context
    from kvlocal.runtime.capture import QueryCapture

    with split_through_relay(smollm2) as (model, relay, contexts):
        cap = QueryCapture.for_model(model)
        ctx = Context(model, 512, cb_eval=cap.callback)
        contexts.append(ctx)
        ctx.decode(model.tokenize("The harbour office opens at nine."))
        token = []
        for armed in (False, False, False, True):
            if armed:
                cap.arm(1)
            c0 = relay.snapshot()
            ctx.decode([model.tokenize(" The", add_special=False)[0]])
            c = relay.snapshot()
            c.subtract(c0)
            if armed:
                cap.take()
            token.append(c)
        for c in token[1:3]:  # the first may differ from the prefill's graph: the next ones reuse it
            assert (c["GRAPH_COMPUTE n"], c["GRAPH_RECOMPUTE n"]) == (0, 1), dict(c)
            assert c["up"] < 20_000, dict(c)  # the token's inputs and a 13-byte request; its graph was ~400 KB
        assert token[3]["GRAPH_COMPUTE n"] > 1  # armed: the graph in pieces, up to each captured query
        print(f"\nper token, disarmed: {token[2]['up'] + token[2]['down']:,} B; armed: "
              f"{token[3]['up'] + token[3]['down']:,} B")
