"""Results file → CSV, a Markdown summary and PNG plots.

Compression loss, as in the CriticalKV paper: ``(full − method) / full`` of a task's score, against the
full F16 cache of the same model, task, seed and context length (undefined where the full cache scores 0).
For ``continuation`` and ``generation`` the score is greedy agreement with the full cache, so their loss is
``1 − agreement``; their mean KL(full ‖ method) gets a column of its own ("KL", "gen KL"). For the chat tasks the
score is the share of turns answered; the cell adds the share confused (answered with another fact's value) and
the share of replies that loop ("0.50 (0.25) c 0.33 l 0.00").
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from kvlocal.eval.tasks import KL_TASKS, REPLY_LOOP

KL_LABELS = {"continuation": "KL", "generation": "gen KL"}  # the summary's columns of the KL_TASKS

COLUMNS = ["model", "model_sha256", "task", "method", "budget", "observation", "seed", "n_tokens", "prompt_tokens",
           "score", "full_score", "loss", "mean_kl", "confused", "missed", "loops", "kv_bytes_allocated", "kv_bytes_full",
           "budget_cells", "n_ctx", "compression_events", "prefill_seconds", "compression_seconds", "host_tier_bytes",
           "recall_seconds", "recall_steps", "recall_steps_confident", "recall_step_seconds", "recall_rows_in", "seconds",
           "command"]


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


def _cell(r: dict, loss: bool) -> str:
    """A task's summary cell: the score, the loss in brackets (``loss``), and for a chat task the shares of
    turns confused (c) and of replies that loop (l)."""
    text = _fmt(r["score"]) + (f" ({_fmt(r['loss'])})" if loss else "")
    return text + (f" c {_fmt(r['confused'])} l {_fmt(r['loops'])}" if "confused" in r else "")


CHAT_LEGEND = ("c: the share of chat turns answered with another fact's value of the document (confused); "
               "l: the share of replies that loop (one span of {} tokens {} times in a reply)".format(*REPLY_LOOP))


def summary(records: list[dict]) -> str:
    """Markdown: per model, a row per method, budget and observation mode; a column per task (score, and
    the loss in brackets; a chat task's confused and looping shares), the mean loss over tasks, the
    continuation's and generation's mean KL(full ‖ method) and the KV MiB allocated (largest over tasks)."""
    lines = []
    by_model = defaultdict(list)
    for r in records:
        by_model[r["model"]].append(r)
    for model, rs in by_model.items():
        tasks = list(dict.fromkeys(r["task"] for r in rs))
        runs = defaultdict(lambda: defaultdict(list))
        for r in rs:
            runs[(r["method"], r["budget"], r["observation"])][r["task"]].append(r)
        rows = {k: {t: over_seeds(v) for t, v in cells.items()} for k, cells in runs.items()}
        kls = [t for t in KL_TASKS if t in tasks]
        seeds = sorted({r["seed"] for r in rs})
        lines += [f"**{model}** ({rs[0]['model_file']}, ~{max(r['prompt_tokens'] for r in rs)} tokens, "
                  f"{'seed' if len(seeds) == 1 else 'the mean over seeds'} {', '.join(map(str, seeds))}):", "",
                  "| method | budget | observation | " + " | ".join(tasks) + " | mean loss |"
                  + "".join(f" {KL_LABELS[t]} |" for t in kls) + " KV MiB |",
                  "|---|---|---|" + "---|" * len(tasks) + "---|" + "---|" * len(kls) + "---|"]
        for (method, budget, obs), cells in rows.items():
            losses = [c["loss"] for c in cells.values() if c["loss"] is not None]
            scores = [_cell(cells[t], method != "full") if t in cells else "" for t in tasks]
            mib = max(c["kv_bytes_allocated"] for c in cells.values()) / 2**20
            kl_cells = "".join(f" {cells[t]['mean_kl']:.3f} |" if t in cells else " |" for t in kls)
            lines.append(f"| {method} | {budget:g} | {obs} | " + " | ".join(scores)
                         + f" | {_fmt(sum(losses) / len(losses)) if losses else '–'} |" + kl_cells
                         + f" {mib:.1f} |")
        lines += ["", CHAT_LEGEND, ""] if any("confused" in r for r in rs) else [""]
    return "\n".join(lines)


def over_seeds(runs: list[dict]) -> dict:
    """One run's figures for a summary cell from the runs of several seeds: the means of its scores, loss, shares
    and KL (the mean over seeds of a chat's shares is the share over all its turns: every seed asks as many), the
    largest KV bytes."""
    out = dict(runs[-1])
    for k in ("score", "loss", "mean_kl", "confused", "missed", "loops"):
        if k in out:
            out[k] = _mean(r.get(k) for r in runs)
    out["kv_bytes_allocated"] = max(r["kv_bytes_allocated"] for r in runs)
    return out


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "**met**" if ok else "**missed**"


def targets(records: list[dict]) -> str:
    """Markdown: issue 11's targets, per model, measured from the records (never asserted): CriticalKV's
    compression loss against SnapKV's (budgets ≤ 0.2, question observation; the paper: at most half),
    eviction on a q8_0 cache against the q4_0 full cache, and the best compressed run at no more KV bytes
    than the q4_0 full cache against it (KL and retrieval). "n/a" where the runs are not in the file."""
    lines = ["**Targets** (measured from the runs above; retrieval = mean score of the tasks other than "
             "continuation and generation, KL = continuation's mean KL against the full F16 cache; "
             "*beats* = lower KL and "
             "retrieval no worse):", ""]
    for model in dict.fromkeys(r["model"] for r in records):
        rs = [r for r in records if r["model"] == model]
        by = defaultdict(list)
        for r in rs:
            by[(r["method"], r["budget"], r["observation"])].append(r)

        def loss(method: str, budgets) -> float | None:
            return _mean(r["loss"] for (m, b, o), runs in by.items() if m == method and b in budgets and o in ("question", "-")
                         for r in runs)

        def figures(runs) -> tuple[float | None, float | None, int]:
            kl = _mean(r.get("mean_kl") for r in runs if r["task"] == "continuation")
            ret = _mean(r["score"] for r in runs if r["task"] not in KL_TASKS)
            return kl, ret, max(r["kv_bytes_allocated"] for r in runs)

        small = sorted({b for (_, b, _) in by if b <= 0.2})
        crit, snap = loss("criticalkv", small), loss("snapkv", small)
        ok = None if crit is None or snap is None else crit <= snap / 2
        if ok is not None:  # (a run without both methods has nothing to say here)
            lines.append(f"- {model} · CriticalKV's mean compression loss ≤ ½ SnapKV's (budgets {', '.join(f'{b:g}' for b in small)}): "
                         f"{_fmt(crit)} vs {_fmt(snap)} — {_verdict(ok)}")
        budgets = sorted({b for (_, b, _) in by if b < 1})
        if any(m == "kvslimmer" for (m, _, _) in by) and any(m == "meanmerge" for (m, _, _) in by):
            pairs = [(b, loss("kvslimmer", [b]), loss("meanmerge", [b])) for b in budgets]
            pairs = [p for p in pairs if None not in p[1:]]
            ok = all(k < m for _, k, m in pairs) if pairs else None
            lines.append(f"- {model} · KVSlimmer's loss below meanmerge's at equal memory: "
                         + ", ".join(f"{b:g}: {_fmt(k)} vs {_fmt(m)}" for b, k, m in pairs) + f" — {_verdict(ok)}")
        if all(any(m == x for (m, _, _) in by) for x in ("criticalkv+kvslimmer", "criticalkv", "kvslimmer")):
            trip = [(b, loss("criticalkv+kvslimmer", [b]), loss("criticalkv", [b]), loss("kvslimmer", [b])) for b in budgets]
            trip = [t for t in trip if None not in t[1:]]
            ok = any(c < min(p1, p2) for _, c, p1, p2 in trip) if trip else None
            lines.append(f"- {model} · criticalkv+kvslimmer's loss below both parents' somewhere: "
                         + ", ".join(f"{b:g}: {_fmt(c)} vs {_fmt(p1)} / {_fmt(p2)}" for b, c, p1, p2 in trip) + f" — {_verdict(ok)}")
        q4 = by.get(("full-kv-q4_0", 1.0, "-"))
        kl4 = figures(q4)[0] if q4 else None
        full_ret = figures(by.get(("full", 1.0, "-"), []))[1] if by.get(("full", 1.0, "-")) else None
        for method in sorted({m for (m, _, _) in by if "+recall" in m}):
            plain = method.replace("+recall", "")
            for b in sorted({b for (m, b, _) in by if m == method}):
                runs = [r for (m, bb, o), rr in by.items() if m == method and bb == b and o in ("question", "chat", "-")
                        for r in rr]
                base = [r for (m, bb, o), rr in by.items() if m == plain and bb == b and o in ("question", "chat", "-")
                        for r in rr]
                kl, ret, nbytes = figures(runs)
                base_bytes = max((r["kv_bytes_allocated"] for r in base), default=None)
                loss_ = None if None in (ret, full_ret) or not full_ret else (full_ret - ret) / full_ret
                ok = None if None in (loss_, kl, kl4) else loss_ <= 0.05 and kl < kl4 and (base_bytes in (None, nbytes))
                tier = max((r.get("host_tier_bytes", 0) for r in runs), default=0)
                lines.append(f"- {model} · {method} at {b:g}: retrieval {_fmt(ret)} vs the full cache's {_fmt(full_ret)} "
                             f"(loss {_fmt(loss_)}, target ≤ 0.05), KL {_fmt3(kl)} vs full-kv-q4_0's {_fmt3(kl4)}, device KV "
                             f"{nbytes / 2**20:.1f} MiB" + (f" ({plain}: {base_bytes / 2**20:.1f})" if base_bytes else "")
                             + f", host tier {tier / 2**20:.1f} MiB — {_verdict(ok)}")
        if not q4:
            continue
        kl4, ret4, bytes4 = figures(q4)
        for method in sorted({m for (m, b, _) in by if m.endswith("@kv-q8_0")}):
            runs = [r for (m, b, _), rr in by.items() if m == method and b <= 0.2 for r in rr]
            for b in sorted({r["budget"] for r in runs}):
                kl, ret, nbytes = figures([r for r in runs if r["budget"] == b])
                ok = None if None in (kl, kl4, ret, ret4) else kl < kl4 and ret >= ret4
                lines.append(f"- {model} · {method} at {b:g} beats the q4_0 K+V full cache: KL {_fmt3(kl)} vs {_fmt3(kl4)}, "
                             f"retrieval {_fmt(ret)} vs {_fmt(ret4)}, {nbytes / 2**20:.1f} vs {bytes4 / 2**20:.1f} MiB — {_verdict(ok)}")
        compressed = [(key, figures(runs)) for key, runs in by.items() if key[1] < 1]
        fits = [(key, f) for key, f in compressed if f[2] <= bytes4]
        if not fits:
            lines.append(f"- {model} · no compressed run fits in the q4_0 K+V full cache's {bytes4 / 2**20:.1f} MiB — **missed**")
            continue
        with_kl = [f for f in fits if f[1][0] is not None]
        (m, b, _), (kl, _, _) = min(with_kl, key=lambda f: f[1][0]) if with_kl else (("–", 0, ""), (None, None, 0))
        best_ret = max((f[1][1] for f in fits if f[1][1] is not None), default=None)
        ok = None if None in (kl, kl4, ret4, best_ret) else kl < kl4 and best_ret >= ret4
        lines.append(f"- {model} · at ≤ the q4_0 K+V full cache's {bytes4 / 2**20:.1f} MiB, the best compressed runs beat it: "
                     f"lowest KL {_fmt3(kl)} ({m} {b:g}) vs {_fmt3(kl4)}, best retrieval {_fmt(best_ret)} vs {_fmt(ret4)} — {_verdict(ok)}")
    return "\n".join(lines) + "\n"


def _fmt3(x) -> str:
    return "–" if x is None else f"{x:.3f}"


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
          "snapkv": "tab:blue", "criticalkv": "tab:red", "snapkv@kv-q8_0": "tab:cyan", "criticalkv@kv-q8_0": "tab:purple",
          "adakv": "tab:olive", "criticalkv+adakv": "tab:gray", "meanmerge": "lightgreen", "kvslimmer": "darkgreen",
          "criticalkv+kvslimmer": "darkred", "defensivekv": "tab:orange", "criticalkv+recall": "crimson",
          "criticalkv+recall@kv-q8_0": "darkviolet", "snapkv+recall": "navy"}
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
    text = summary(records) + "\n" + targets(records)
    try:
        pngs = plots(records, out)
    except ImportError:
        pngs = []
        text += "\n(no plots: matplotlib is not installed; `pip install matplotlib`)\n"
    (out / "summary.md").write_text(text)
    return text, pngs
