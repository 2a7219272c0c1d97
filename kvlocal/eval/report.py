"""Results file → CSV, a Markdown summary and PNG plots.

Compression loss, as in the CriticalKV paper: ``(full − method) / full`` of a task's score, against the
full F16 cache of the same model, task, seed and context length (undefined where the full cache scores 0).
For ``continuation`` the score is greedy agreement with the full cache, so its loss is ``1 − agreement``.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

COLUMNS = ["model", "model_sha256", "task", "method", "budget", "observation", "seed", "n_tokens", "prompt_tokens",
           "score", "full_score", "loss", "mean_kl", "kv_bytes_allocated", "kv_bytes_full", "budget_cells", "n_ctx",
           "compression_events", "prefill_seconds", "compression_seconds", "seconds", "command"]


def load(path: Path) -> list[dict]:
    """The records of a results file (a torn last line is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _group(r: dict) -> tuple:
    return r["model"], r["task"], r["seed"], r["n_tokens"]


def with_loss(records: list[dict]) -> list[dict]:
    """Records with ``full_score`` and ``loss`` (None where there is no full run or it scored 0)."""
    full = {_group(r): r["score"] for r in records if r["method"] == "full"}
    out = []
    for r in records:
        f = full.get(_group(r))
        out.append({**r, "full_score": f, "loss": (f - r["score"]) / f if f else None})
    return out


def write_csv(records: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)


def short_name(model: str) -> str:
    """A model argument as a file-name part: the known name, or a path's file name without ``.gguf``."""
    name = Path(model).name
    return name[:-5] if name.endswith(".gguf") else name


def _label(r: dict) -> str:
    return r["method"] if r["observation"] == "-" else f"{r['method']} ({r['observation']})"


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def summary(records: list[dict]) -> str:
    """Markdown: per model, a row per method, budget and observation mode; a column per task (score, and
    the loss in brackets), the mean loss over tasks, the continuation's mean KL(full ‖ method) and the KV
    MiB allocated (largest over tasks)."""
    lines = []
    by_model = defaultdict(list)
    for r in records:
        by_model[r["model"]].append(r)
    for model, rs in by_model.items():
        tasks = list(dict.fromkeys(r["task"] for r in rs))
        rows = defaultdict(dict)
        for r in rs:
            rows[(r["method"], r["budget"], r["observation"])][r["task"]] = r
        kl = "continuation" in tasks
        lines += [f"**{model}** ({rs[0]['model_file']}, ~{max(r['prompt_tokens'] for r in rs)} tokens, seed {rs[0]['seed']}):", "",
                  "| method | budget | observation | " + " | ".join(tasks) + " | mean loss |" + (" KL |" if kl else "")
                  + " KV MiB |",
                  "|---|---|---|" + "---|" * len(tasks) + "---|" + ("---|" if kl else "") + "---|"]
        for (method, budget, obs), cells in rows.items():
            losses = [c["loss"] for c in cells.values() if c["loss"] is not None]
            scores = [f"{_fmt(cells[t]['score'])}" + (f" ({_fmt(cells[t]['loss'])})" if method != "full" and t in cells else "")
                      if t in cells else "" for t in tasks]
            mib = max(c["kv_bytes_allocated"] for c in cells.values()) / 2**20
            kl_cell = f" {cells['continuation']['mean_kl']:.3f} |" if "continuation" in cells else " |"
            lines.append(f"| {method} | {budget:g} | {obs} | " + " | ".join(scores)
                         + f" | {_fmt(sum(losses) / len(losses)) if losses else '–'} |" + (kl_cell if kl else "")
                         + f" {mib:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plots(records: list[dict], out: Path) -> list[Path]:
    """Per model: quality vs budget (one panel per task) and quality vs KV bytes with the full caches
    (F16, q8_0 and q4_0 K) as baselines. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for model in dict.fromkeys(r["model"] for r in records):
        rs = [r for r in records if r["model"] == model]
        tasks = list(dict.fromkeys(r["task"] for r in rs))
        for kind in ("budget", "bytes"):
            fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), squeeze=False)
            for ax, task in zip(axes[0], tasks):
                _panel(ax, [r for r in rs if r["task"] == task], kind)
                ax.set_title(task)
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"{model}: {'score vs budget' if kind == 'budget' else 'score vs KV bytes allocated'}")
            fig.tight_layout()
            path = out / f"{short_name(model)}-{kind}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


COLORS = {"full": "black", "full-q8_0": "tab:orange", "full-q4_0": "tab:brown", "full-kv-q8_0": "gold",
          "full-kv-q4_0": "tab:pink", "streaming": "tab:green",
          "snapkv": "tab:blue", "criticalkv": "tab:red"}
DASHES = {"agnostic": "--"}  # question-aware and query-free methods: solid


def _panel(ax, rs: list[dict], kind: str) -> None:
    lines = defaultdict(list)
    for r in rs:
        lines[_label(r)].append(r)
    for label, pts in lines.items():
        pts.sort(key=lambda r: r["budget"])
        color, baseline = COLORS.get(pts[0]["method"]), pts[0]["method"].startswith("full")
        if kind == "budget":
            if baseline:
                ax.axhline(pts[0]["score"], ls=":", lw=1.2, label=label, color=color)
                continue
            xs = [r["budget"] for r in pts]
        else:
            xs = [r["kv_bytes_allocated"] / 2**20 for r in pts]
        ax.plot(xs, [r["score"] for r in pts], "s" if baseline else "o", ls="none" if baseline else DASHES.get(pts[0]["observation"], "-"),
                label=label, ms=5, color=color)
    ax.set_xlabel("budget (ratio of tokens)" if kind == "budget" else "KV MiB allocated")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)


def write_all(results: Path, out: Path) -> tuple[str, list[Path]]:
    """CSV, summary.md and the plots next to the results file; returns the summary and the plot files
    (none, with a note in the summary, where matplotlib is missing)."""
    records = with_loss(load(results))
    write_csv(records, out / "results.csv")
    text = summary(records)
    try:
        pngs = plots(records, out)
    except ImportError:
        pngs = []
        text += "\n(no plots: matplotlib is not installed; `pip install matplotlib`)\n"
    (out / "summary.md").write_text(text)
    return text, pngs
