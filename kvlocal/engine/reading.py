"""A long turn read whole (``Engine(read_cells=)``): its tokens are decoded in a *reading context* that holds the
cache so far and the whole turn — on the host: llama.cpp's KV cache and the attention over it stay in host memory
(``--no-kv-offload``) where the model's layers are on a GPU — and one compression event then leaves the budget's
rows, which move to the budget's context; the others go to the recall tier, as any event's do.

Why: read in chunks inside the budget's context, every chunk's tokens attend to the rows the events before it left,
so the keys and values of all but the first chunk are computed over a tenth of what came before them and drift from
the full cache's (at budget 0.1 on Qwen2.5-Coder-0.5B, the values of the document's last quarter in layer 12 at
cosine 0.91; ``python -m tools.recall_binding``). The recall tier brings rows back, but it brings back those drifted
rows, and between facts of one template that decides which value the answer copies (docs/recall.md § Similar facts).
Read whole, every row is the full cache's; the device holds the budget's cells throughout, and the host holds the
turn's rows once (the tier holds them after the event anyway). With ``read_cells`` below what the turn needs, the
reading context holds that many cells and compresses whenever it is full: fewer, larger events than the budget's.

The budget's context is left as it was until the turn is read; if reading fails or is interrupted it is still the
cache before the turn (the engine's record and position with it), and the reading context is freed. Where llama.cpp
cannot allocate the reading context, the turn is read in the budget's context (``EngineStats.reading_refused``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from kvlocal.engine.interrupts import interrupts_deferred
from kvlocal.engine.undo import copy_cells
from kvlocal.errors import UsageError
from kvlocal.runtime import Context, clear_seq, set_blob


@contextlib.contextmanager
def read_whole(engine, n_cells: int) -> Iterator[None]:
    """While the block runs, ``engine`` decodes and compresses in a reading context of ``n_cells`` cells (seeded with
    the budget's cells); then the cells it left replace the budget's context's."""
    device, kv, cells = engine.ctx, engine.kv, engine.cells
    try:
        reading = Context(engine.model, n_ctx=n_cells, n_batch=device.n_batch, n_threads=device.n_threads,
                          type_k=device.type_k, type_v=device.type_v, cb_eval=engine.capture.callback,
                          flash_attn=device.flash_attn, offload_kqv=False)
    except UsageError:  # llama.cpp could not allocate it (host memory): read in the budget's context, as without
        engine.stats.reading_refused += 1
        yield
        return
    seed = kv.save() if engine.live_cells() else None
    copy_cells(engine, seed)  # an open turn's undo loads the cells it began with back into the budget's context
    before = engine.n_past, engine.logits, kv.record, engine.compressor.settled, engine.stats.kv_cells_live_peak

    def use(ctx) -> None:
        engine.ctx = cells.ctx = ctx
        kv.use(ctx)

    try:
        use(reading)
        if seed is not None:
            set_blob(reading, seed)
        engine.stats.reading_bytes_peak = max(engine.stats.reading_bytes_peak, sum(reading.kv_bytes() or (0,)))
        yield
        left = kv.save()
    except BaseException:
        use(device)  # untouched: the cache before the turn
        engine.n_past, engine.logits, kv.record, engine.compressor.settled, engine.stats.kv_cells_live_peak = before
        reading.close()
        raise
    with interrupts_deferred():
        use(device)
        clear_seq(device)
        try:
            set_blob(device, left)
        except RuntimeError as e:
            cells.broken = f"the cells read could not be moved to the budget's context: {e}"
            raise
        finally:
            reading.close()
    engine.stats.reading_contexts += 1
    engine.stats.kv_cells_live_peak = max(before[4], engine.live_cells())
