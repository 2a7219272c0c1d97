"""``kvlocal eval``: methods × budgets × tasks × models on seeded tasks over real text (docs/eval.md).

``tasks`` generates the items, ``runner`` runs them on the engine into a resumable JSON-lines file,
``report`` turns that file into a CSV, a Markdown summary and PNG plots, ``command`` is the CLI."""

from .command import add_arguments, run

__all__ = ["add_arguments", "run"]
