"""``kvlocal eval``: methods × budgets × tasks × models on seeded tasks over real text (docs/eval.md).

``tasks`` generates the items, ``runner`` runs them on the engine into a resumable JSON-lines file,
``report`` turns that file into a CSV, a Markdown summary and PNG plots, ``command`` is the CLI.
``perturbation`` is the CriticalKV paper's output-perturbation analysis on the PyTorch reference
(``--perturbation``, run instead of the tasks)."""

from kvlocal.eval import command


def add_arguments(p) -> None:
    command.add_arguments(p)
    p.add_argument("--perturbation", action="store_true",
                   help="instead of the tasks: the CriticalKV paper's output-perturbation analysis on the PyTorch "
                        "reference (per-head ||o - o^||_1 and the final hidden state, per method and budget), into "
                        "DIR/perturbation.jsonl and DIR/perturbation.md (docs/eval.md)")


def run(args) -> int:
    if getattr(args, "perturbation", False):
        from kvlocal.eval import perturbation

        return perturbation.run(args)
    return command.run(args)


__all__ = ["add_arguments", "run"]
