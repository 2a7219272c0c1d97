"""``kvlocal doctor --plan MODEL``: what each machine of a split run needs — the model's weights and its KV cache,
with and without a budget — computed from the GGUF file's header (nothing is loaded, no server is asked).

Layers go where llama.cpp puts them (``llama_model::load_tensors``): the token embeddings and the first
``n_layer + 1 - ngl`` layers stay on this machine; the rest — the output layer counted as layer ``n_layer`` —
divide among the devices by the cumulative shares of ``--tensor-split`` (each ``--rpc`` server counted as one
device). A layer's KV cache lives on its layer's device. Without ``--tensor-split`` the shares here are equal;
llama.cpp's own default is by the devices' free memory, so give ``-ts`` to plan exactly what it will do.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from kvlocal.engine.config import Budget
from kvlocal.models.arch import arch_info, gguf_meta
from kvlocal.models.gguf_file import read_gguf
from kvlocal.runtime import BIAS_BYTES, N_UBATCH, pad_cells

HOST = "this machine"


@dataclass
class Share:
    """One machine's part of the model: its layers (``n_layer`` is the output layer), weight bytes, and KV bytes
    for the whole context and for the budget's context."""

    name: str
    layers: list[int] = field(default_factory=list)
    weights: int = 0
    kv_full: int = 0
    kv_budget: int = 0


def layer_devices(n_layer: int, n_gpu_layers: int, split: list[float]) -> list[int]:
    """For each layer 0..n_layer (the last: the output), the index of its device (-1: this machine), as llama.cpp
    assigns them: ``split`` the devices' shares."""
    n_gpu_layers = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    start = max(n_layer + 1 - n_gpu_layers, 0)
    active = min(n_gpu_layers, n_layer + 1) if split else 0
    bounds = [sum(split[:i + 1]) / sum(split) for i in range(len(split))]
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(-1)
        else:
            out.append(min(bisect.bisect_right(bounds, (il - start) / active), len(split) - 1))
    return out


def _row_bytes(type_name: str) -> float:
    """Bytes of one cache value of type ``type_name`` (f16: 2, q8_0: 34/32, ...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    return size / block


def plan(path, n_ctx: int, budget: str, n_gpu_layers: int, devices: list[str], split: list[float] | None = None,
         type_k: str = "f16", type_v: str = "f16", chunk: int = 128, recent: int = 32) -> list[Share]:
    """Each machine's :class:`Share` of the model at ``path`` for a context of ``n_ctx`` tokens: this machine first,
    then ``devices`` in order. The budget's context is what the default method allocates: ``budget`` cells (at
    least a sliding window's) plus ``chunk`` and ``recent``, padded to 256; a sliding-window layer holds its window
    and a micro-batch, at most the context."""
    header = read_gguf(path)
    arch = arch_info(gguf_meta(header), str(path))
    split = (list(split or ()) + [0.0] * len(devices))[:len(devices)]  # llama.cpp reads one share per device
    if not any(split):
        split = [1.0] * len(devices)
    placed = layer_devices(arch.n_layer, n_gpu_layers if devices else 0, split)
    shares = [Share(HOST)] + [Share(d) for d in devices]
    for il in range(arch.n_layer + 1):
        shares[placed[il] + 1].layers.append(il)
    for t in header.tensors:
        if t.name.startswith("blk."):
            il = int(t.name.split(".")[1])
        elif t.name.startswith("output"):
            il = arch.n_layer
        else:  # token embeddings (and rope factors): the input layer, always here
            shares[0].weights += t.n_bytes
            continue
        shares[placed[il] + 1].weights += t.n_bytes
    names = {t.name: t for t in header.tensors}
    if "output.weight" not in names and placed[arch.n_layer] >= 0 and "token_embd.weight" in names:
        shares[placed[arch.n_layer] + 1].weights += names["token_embd.weight"].n_bytes  # tied: llama.cpp copies it
    row = (arch.head_dim_k * _row_bytes(type_k) + arch.head_dim_v * _row_bytes(type_v) + BIAS_BYTES) * arch.n_head_kv
    cells = pad_cells(n_ctx)
    # the engine's context: the budget, a chunk and the recent span — at least the sliding window and those two
    budget_cells = min(cells, pad_cells(max(Budget.parse(budget).cells_for(n_ctx, 0), arch.n_swa) + chunk + recent))

    def layer_cells(il: int, ctx: int) -> int:  # a sliding layer's cache: min(n_ctx, window + ubatch), padded
        return min(ctx, pad_cells(arch.n_swa + N_UBATCH)) if arch.swa[il] else ctx

    for il in range(arch.n_layer):
        s = shares[placed[il] + 1]
        s.kv_full += math.ceil(layer_cells(il, cells) * row)
        s.kv_budget += math.ceil(layer_cells(il, budget_cells) * row)
    return shares


def _layers_text(layers: list[int], n_layer: int) -> str:
    if not layers:
        return "none (the token embeddings only)"
    body = [il for il in layers if il < n_layer]
    text = f"{body[0]}-{body[-1]}" if len(body) > 1 else (str(body[0]) if body else "")
    return text + (" + output" if n_layer in layers else "") if text else "output"


def rows(path, n_ctx: int, budget: str, n_gpu_layers: int, devices: list[str], split: list[float] | None = None,
         type_k: str = "f16", type_v: str = "f16") -> list[tuple[str, str]]:
    """``kvlocal doctor``'s rows for the plan: one per machine, then the totals."""
    n_layer = arch_info(gguf_meta(read_gguf(path)), str(path)).n_layer
    shares = plan(path, n_ctx, budget, n_gpu_layers, devices, split, type_k, type_v)
    gib = 2 ** 30
    out = [("plan", f"{path} at -c {n_ctx} ({type_k}/{type_v} cache), -ngl {n_gpu_layers}"
                    + (f" over {len(devices)} rpc-server(s), " + ("-ts " + ",".join(f"{x:g}" for x in split)
                                                               if split else "equal shares") if devices else "")
                    + f": weights + KV, the whole context · with --budget {budget}")]
    for s in shares:
        out.append(("", f"{s.name}: layers {_layers_text(s.layers, n_layer)}: {s.weights / gib:.2f} GiB weights + "
                        f"{s.kv_full / gib:.2f} GiB KV = {(s.weights + s.kv_full) / gib:.2f} GiB · with the budget "
                        f"{s.kv_budget / gib:.2f} GiB KV = {(s.weights + s.kv_budget) / gib:.2f} GiB"))
    full, bounded = sum(s.kv_full for s in shares), sum(s.kv_budget for s in shares)
    out.append(("", f"KV in all: {full / gib:.2f} GiB for the whole context, {bounded / gib:.2f} GiB with the budget "
                    f"({bounded / full:.0%}); not counted: compute buffers (llama.cpp's, a few hundred MiB per device "
                    f"at 8B), the recall tier (host memory, capped by --recall-mem)"))
    return out
