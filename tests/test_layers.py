"""The repo's import check: kvlocal's layers, declared once, and no import that runs upward.

Every module of ``kvlocal/`` is parsed (``ast``; nothing is imported, so the check needs neither llama.cpp nor a
model) and each ``import`` in it, at the top or inside a function, is held to :data:`LAYERS`: a module may import
its own folder and the layers below its own, never a layer above it nor another folder of its own layer (peers
know nothing of each other: ``runtime/`` talks to llama.cpp and knows nothing of the scorers in ``compress/``).

Run against another tree (a worktree of an older commit) with ``python tests/test_layers.py ROOT``: it prints each
upward import and exits 1 where there is one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Bottom to top. A module of kvlocal belongs to the layer that names its top-level folder or file; the folders of
# one tuple are peers.
LAYERS = (
    ("errors", "version", "registry"),  # what every layer may raise or say; registries read from their modules
    ("kernels", "units"),            # the C kernels' binding (kvlocal._kernels), numpy in and out; sizes as people
                                     # write them (512M)
    ("models",),                     # GGUF files: headers, tensors, the registry of known models
    ("runtime", "compress", "reference"),  # llama.cpp; the scorers and plans (numpy); their PyTorch twins
    ("backends", "recall"),          # plans applied to llama.cpp's cache; the recall tier's host rows
    ("engine",),                     # one cache under a budget: observe, score, plan, apply, re-select
    ("settings",),                   # what a chat depends on, declared once
    ("chat",),                       # a conversation on an engine
    ("options",),                    # the command line's shared flags
    ("eval", "server", "llama_compat"),  # the evaluation runner; the HTTP server; kvlocal.Llama (llama-cpp-python's
                                     # API) — peers: kvlocal.Llama shares the conversation core with the server, and
                                     # imports none of it
    ("cli",),                        # the commands
    ("__main__", "__init__"),        # `python -m kvlocal`; the package's face (kvlocal.Chat, kvlocal.Llama)
)
ALIASES = {"_kernels": "kernels"}  # the compiled extension is part of its binding's layer

ROOT = Path(__file__).resolve().parent.parent


def layer_of(part: str) -> int | None:
    """The index in :data:`LAYERS` of kvlocal's top-level folder or module ``part``; None if it is declared nowhere."""
    part = ALIASES.get(part, part)
    return next((i for i, names in enumerate(LAYERS) if part in names), None)


def top_part(module: str) -> str:
    """``kvlocal.runtime.llama`` -> ``runtime``; ``kvlocal`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(path: Path, package: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every kvlocal module ``path`` imports, relative imports resolved; a name imported
    from a package (``from kvlocal import kernels``) counts as the submodule where one of that name exists."""
    rel = path.relative_to(package.parent).with_suffix("")
    here = list(rel.parts[:-1])  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvlocal"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != "kvlocal":
                continue
            for alias in node.names:
                sub = package.parent.joinpath(*base.split("."), alias.name)
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file() or any(
                    sub.parent.glob(alias.name + ".*.so"))
                out.append((node.lineno, f"{base}.{alias.name}" if is_module else base))
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import in ``root``/kvlocal that breaks :data:`LAYERS`, as ``file:line: a (layer) imports b (layer)``;
    a module whose folder is in no layer is one too (declare it)."""
    package = root / "kvlocal"
    problems = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        mine = rel.parts[0].removesuffix(".py")  # runtime/llama.py -> runtime; errors.py -> errors
        me = layer_of(mine)
        if me is None:
            problems.append(f"kvlocal/{rel}: kvlocal.{mine} is in no layer of tests/test_layers.py's LAYERS")
            continue
        for line, module in imported(path, package):
            theirs = top_part(module)
            them = layer_of(theirs)
            if ALIASES.get(theirs, theirs) == mine:
                continue
            if them is None or them >= me:
                where = "a peer" if them == me else "above" if them is not None else "in no layer"
                problems.append(f"kvlocal/{rel}:{line}: {mine} imports {module} ({where})")
    return list(dict.fromkeys(problems))  # `from a import b, c` on one line: said once


def test_no_import_runs_upward():
    """Each problem names the file, the line and what it imports; fix it by moving the code it needs to the layer
    that owns it, not by moving the layer."""
    problems = upward_imports()
    assert not problems, "\n".join(problems)


def test_runtime_knows_nothing_of_the_scorers():
    """The rule the layers exist for, said on its own: nothing under runtime/ imports compress/ (nor the backends)."""
    package = ROOT / "kvlocal"
    found = [f"{p.relative_to(ROOT)}:{line}: {m}" for p in sorted((package / "runtime").rglob("*.py"))
             for line, m in imported(p, package) if top_part(m) in ("compress", "backends", "recall", "engine", "chat")]
    assert not found, "\n".join(found)
    assert any((package / "runtime").rglob("*.py"))  # the check read something


def test_the_check_sees_an_upward_import(tmp_path):
    """A runtime module that imports a scorer, and a folder declared in no layer, are both reported."""
    package = tmp_path / "kvlocal"
    for folder in ("runtime", "compress", "mystery"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "runtime" / "backend.py").write_text("from kvlocal.compress import Plan\nfrom kvlocal import errors\n")
    (package / "errors.py").write_text("")
    problems = upward_imports(tmp_path)
    assert problems == ["kvlocal/mystery/__init__.py: kvlocal.mystery is in no layer of tests/test_layers.py's LAYERS",
                        "kvlocal/runtime/backend.py:1: runtime imports kvlocal.compress (a peer)"], problems


if __name__ == "__main__":
    found = upward_imports(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("\n".join(found) or "no upward import")
    print(f"{len(found)} upward import(s)")
    sys.exit(1 if found else 0)
