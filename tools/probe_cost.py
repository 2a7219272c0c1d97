"""What a probe decoded with a prompt chunk really costs, against the share of the decode the engine counts for it.

    python -m tools.probe_cost smollm2-135m                  # 600 cells held, a 383-token chunk, a 32-token probe
    python -m tools.probe_cost qwen2.5-coder-0.5b --repeat 30

A compression event inside a prompt decodes its probe in the same graph as the chunk before it
(``Observer.decode_chunk``), and the engine counts the probe's part of that decode by token share: the decode's
time × probe tokens / all tokens (``observe`` in ``EngineStats.compression_breakdown``, the ``observe s`` of ``kvlocal
bench``). The probe's tokens come last, and attend to more cells than the chunk's on average; the capture of their
queries splits the graph. Here a context holding ``--cells`` tokens decodes the chunk alone, the chunk with the probe
unarmed, and with the probe's queries captured, alternating, ``--repeat`` times, and prints the medians: the probe's
marginal cost (its tokens, then the capture) beside the token-share figure the engine counts. Figures of one run on
one machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlocal.cli.bench import long_text
from kvlocal.models import resolve
from kvlocal.runtime import Context, Model, QueryCapture


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cells", type=int, default=600, help="tokens held before the chunk (an event's low water)")
    ap.add_argument("--chunk", type=int, default=383, help="the chunk's tokens (what the free cells take)")
    ap.add_argument("--probe", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=15, help="the VM's noise is of the probe's size: 15 or more")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    model = Model(resolve(a.model))
    tokens = long_text(model, a.cells + a.chunk + a.probe)
    held, chunk, probe = tokens[:a.cells], tokens[a.cells:a.cells + a.chunk], tokens[a.cells + a.chunk:]
    cap = QueryCapture.for_model(model)
    ctx = Context(model, n_ctx=a.cells + a.chunk + a.probe + 256, n_batch=max(512, a.chunk + a.probe),
                  n_threads=a.threads, cb_eval=cap.callback)
    ctx.decode(held, list(range(a.cells)), "last")
    ways = {"chunk": (chunk, False), "chunk + probe": (chunk + probe, False),
            "chunk + probe, captured": (chunk + probe, True)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(a.repeat):
        for name, (seq, armed) in ways.items():
            if armed:
                cap.arm(len(probe))
            t0 = time.perf_counter()
            ctx.decode(seq, list(range(a.cells, a.cells + len(seq))), len(chunk) - 1)
            seconds[name].append(time.perf_counter() - t0)
            if armed:
                cap.take()
            ctx.remove(a.cells, -1)
    alone, with_probe, captured = (statistics.median(seconds[name]) for name in ways)
    counted = captured * len(probe) / (len(chunk) + len(probe))
    print(f"{model.path.name} · {a.cells} cells held · chunk {len(chunk)} · probe {len(probe)} · {a.repeat} repeats "
          f"(medians, ms)")
    print(f"  chunk alone {1000 * alone:.1f}, with the probe {1000 * with_probe:.1f}, with its queries captured "
          f"{1000 * captured:.1f}")
    print(f"  the probe's cost: tokens {1000 * (with_probe - alone):.1f} + capture {1000 * (captured - with_probe):.1f}"
          f" = {1000 * (captured - alone):.1f}; counted by token share {1000 * counted:.1f} "
          f"({(captured - alone) / counted:.2f}x)")


if __name__ == "__main__":
    main()
