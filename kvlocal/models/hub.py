"""GGUF files from a Hugging Face hub: ``kvlocal pull OWNER/REPO[:QUANT]`` and ``OWNER/REPO/FILE.gguf``.

The spec is llama.cpp's ``-hf`` syntax, so a model line copied from a model page works as is:

* ``OWNER/REPO:QUANT`` — the repo's .gguf file whose name has the quant tag (``Q4_K_M``, ``q8_0``; any
  case; the tag must stand alone, so ``Q4_K`` does not match ``Q4_K_M``);
* ``OWNER/REPO`` — the repo's only model file, else its ``Q4_K_M`` file (llama.cpp's default);
* ``OWNER/REPO/PATH/FILE.gguf`` — one file, possibly in a folder of the repo;
* ``hf:`` before any of these reads it as a hub spec even where a local path of that name exists.

Vision projectors (names with ``mmproj``) are not models and are never picked. A file split by
``llama-gguf-split`` (``-00001-of-00003.gguf``) is refused: kvlocal reads the weights of one file
itself (the CriticalKV output projections), so the parts must be merged first.

Everything goes through ``huggingface_hub``: the host is its ``HF_ENDPOINT`` (its own default when
unset), files go into its cache (``HF_HOME`` / ``HF_HUB_CACHE``, shared with every other tool that
uses it), the token is ``HF_TOKEN`` or its login, and ``HF_HUB_OFFLINE=1`` keeps it off the network.
The repo is listed online each time, so a new upload is seen; when the hub cannot be reached the
choice is made among the files of the cached snapshot instead. A download that is not a whole GGUF
file is removed from the hub cache before the error is raised.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvlocal.errors import UsageError

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's pick for a bare OWNER/REPO
LIST_TIMEOUT = 10  # seconds for the listing; huggingface_hub's own timeouts cover the download
_NAME = r"[A-Za-z0-9][\w.-]*"
_SPEC = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[\w.-]+)|/(?P<file>(?:{_NAME}/)*{_NAME}\.gguf))?", re.I)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
OFFLINE_SET = "HF_HUB_OFFLINE is set"
LOGIN = "set HF_TOKEN or log in (`hf auth login`; `huggingface-cli login` before huggingface_hub 1.0)"


@dataclass(frozen=True)
class HubSpec:
    repo: str
    quant: str | None = None
    file: str | None = None
    forced: bool = False  # written with hf:

    def __str__(self) -> str:
        return ("hf:" if self.forced else "") + self.repo + (f":{self.quant}" if self.quant else f"/{self.file}" if self.file else "")


def parse(spec: str) -> HubSpec | None:
    """The hub spec in a model argument, or None where it names a local path (or is no spec at all).

    Without ``hf:``, an existing path stays a path, and so do ``./x``, ``/x``, ``~/x`` and a two-part
    ``dir/model.gguf`` (a missing local file, not a repo ending in .gguf)."""
    forced = spec.startswith("hf:")
    body = spec[3:] if forced else spec
    m = _SPEC.fullmatch(body)
    if not m:
        if forced:
            raise UsageError(f"'{spec}' is not a hub spec: write hf:OWNER/REPO, hf:OWNER/REPO:QUANT or hf:OWNER/REPO/FILE.gguf")
        return None
    if not forced and (Path(spec).exists() or (not m["quant"] and not m["file"] and body.lower().endswith(".gguf"))):
        return None
    return HubSpec(m["repo"], m["quant"], m["file"], forced)


def _is_model(path: str) -> bool:
    """A .gguf file that is a model: not a vision projector, not the second or later part of a split."""
    name = path.rsplit("/", 1)[-1].lower()
    split = _SPLIT.search(name)
    return name.endswith(".gguf") and "mmproj" not in name and (not split or int(split[1]) == 1)


def _has_tag(path: str, tag: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", name, re.I) is not None


def _listing(files: list[str], most: int = 12) -> str:
    if not files:
        return "it has no .gguf model files (kvlocal runs GGUF models: look for a GGUF conversion of this model)"
    more = f" … ({len(files) - most} more)" if len(files) > most else ""
    return "its .gguf files: " + ", ".join(files[:most]) + more


def pick(spec: HubSpec, files: list[str]) -> str:
    """The file of a repo listing that the spec names; UsageError listing the candidates otherwise."""
    models = sorted(f for f in files if _is_model(f))
    if spec.file:
        if spec.file not in files:
            raise UsageError(f"{spec.repo} has no file {spec.file}; {_listing(models)}")
        name = spec.file
    else:
        tag = spec.quant or DEFAULT_QUANT
        hits = models if not spec.quant and len(models) == 1 else [f for f in models if _has_tag(f, tag)]
        if len(hits) != 1:
            what = f"'{spec.quant}' matches {len(hits) or 'no'} files" if spec.quant else \
                f"{len(models)} model files and {len(hits) or 'none'} {'is' if len(hits) < 2 else 'are'} {DEFAULT_QUANT}"
            raise UsageError(f"{spec.repo}: {what}; name one as {spec.repo}:QUANT or {spec.repo}/FILE.gguf — {_listing(models)}")
        name = hits[0]
    split = _SPLIT.search(name)
    if split:
        raise UsageError(f"{spec.repo}/{name} is part of a GGUF split in {int(split[2])} files, and kvlocal reads one file: "
                         f"merge them with llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf` and pass OUT.gguf, "
                         f"or pick a quant that is one file")
    return name


def cached_files(repo: str) -> list[str]:
    """The files of the snapshot of ``main`` in the hub cache (its documented layout), for offline choice."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))
    ref = folder / "refs" / "main"
    if not ref.is_file():
        return []
    snapshot = folder / "snapshots" / ref.read_text().strip()
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _error(spec: HubSpec, e: Exception, name: str | None = None) -> UsageError:
    """One line naming the problem and the fix, for an exception from huggingface_hub."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       OfflineModeIsEnabled, RepositoryNotFoundError)

    where, what = constants.ENDPOINT, f"{spec.repo}/{name}" if name else str(spec)
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError) or (isinstance(e, HfHubHTTPError) and status == 403):
        return UsageError(f"{spec.repo} on {where} is gated (HTTP {status}): accept its terms on the model page, then {LOGIN}")
    if isinstance(e, RepositoryNotFoundError):
        local = "" if spec.forced else f", and there is no local file '{spec}'"
        return UsageError(f"no repository {spec.repo} on {where} (HTTP {status}){local}; check the name, "
                          f"or if it is private {LOGIN}")
    if isinstance(e, OfflineModeIsEnabled):
        return UsageError(f"HF_HUB_OFFLINE is set and {what} is not in the hub cache ({constants.HF_HUB_CACHE}); "
                          f"unset it to download, or run `kvlocal pull {spec}` where there is a network")
    if isinstance(e, LocalEntryNotFoundError):
        return UsageError(f"cannot reach {where} and {what} is not in the hub cache ({constants.HF_HUB_CACHE}); "
                          "check the network, or HF_ENDPOINT")
    if isinstance(e, EntryNotFoundError):
        return UsageError(f"{spec.repo} on {where} has no file {name}; `kvlocal pull {spec.repo}` lists its .gguf files")
    if isinstance(e, HfHubHTTPError):
        return UsageError(f"{where} answered HTTP {status} for {what}; try again later, or check HF_ENDPOINT")
    first = (str(e).strip().splitlines() or [""])[0]
    return UsageError(f"cannot download {what} from {where} ({type(e).__name__}: {first}); check the network, or HF_ENDPOINT")


@contextlib.contextmanager
def _progress_bars(show: bool):
    """huggingface_hub's own download bars (on stderr) unless quiet; its switch is process-wide, so restored."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_off = are_progress_bars_disabled()
    if not show and not was_off:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_off:
            enable_progress_bars()


def _list_repo(spec: HubSpec) -> tuple[list[str] | None, str | None]:
    """The repo's files from the hub, or (None, why) when the hub cannot be asked: unreachable,
    answering 5xx, or HF_HUB_OFFLINE. A plain GET without retries, so offline use is not delayed."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    try:
        return [s.rfilename for s in HfApi().model_info(spec.repo, timeout=LIST_TIMEOUT).siblings or []], None
    except HfHubHTTPError as e:
        if (getattr(e.response, "status_code", 0) or 0) < 500:
            raise _error(spec, e) from None
        return None, f"HTTP {e.response.status_code}"
    except HFValidationError as e:
        raise UsageError(f"'{spec.repo}' is not a repo id the hub accepts ({str(e).splitlines()[0]})") from None
    except OfflineModeIsEnabled:
        return None, OFFLINE_SET
    except Exception as e:  # the HTTP client's own connection errors, which differ between versions
        return None, type(e).__name__


def _pick_cached(spec: HubSpec, offline: str, force: bool, quiet: bool, download: bool) -> str:
    """The file for a spec among those of the cached snapshot, when the hub cannot be asked."""
    from huggingface_hub import constants

    deliberate = offline == OFFLINE_SET
    why, fix = (offline, "unset HF_HUB_OFFLINE") if deliberate else \
        (f"cannot reach {constants.ENDPOINT} ({offline})", "check the network, or HF_ENDPOINT")
    if force:
        raise UsageError(f"{why}, so {spec} cannot be downloaded again; {fix}")
    try:
        name = pick(spec, cached_files(spec.repo))
    except UsageError:
        if not download:
            raise UsageError(f"{spec} is not downloaded yet: run `kvlocal pull {spec}`") from None
        raise UsageError(f"{why}, and the hub cache ({constants.HF_HUB_CACHE}) has no file for {spec}; {fix}") from None
    if download and not quiet and not deliberate:
        print(f"kvlocal: {why}; using the cached {spec.repo}/{name}", file=sys.stderr)
    return name


def fetch(spec: HubSpec, force: bool = False, quiet: bool = False, download: bool = True) -> Path:
    """The path in the hub cache of the GGUF file a spec names, downloaded if needed and checked whole.

    Online, the repo is listed and the file brought up to date with ``main``; when the hub cannot be
    asked, or with ``download=False`` (no network at all), the cached snapshot is used if it has the file."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    from kvlocal.models.gguf_file import check_gguf

    files, offline = _list_repo(spec) if download else (None, "not pulled")
    if files is None:
        name = _pick_cached(spec, offline, force, quiet, download)
    else:
        name = pick(spec, files)
        if not quiet and (force or not isinstance(try_to_load_from_cache(spec.repo, name), str)):
            print(f"kvlocal: downloading {name} from {spec.repo} into {constants.HF_HUB_CACHE}", file=sys.stderr, flush=True)
    try:
        with _progress_bars(not quiet):
            path = Path(hf_hub_download(spec.repo, name, force_download=force, local_files_only=offline is not None))
    except Exception as e:
        raise _error(spec, e, name) from None
    try:
        return check_gguf(path)
    except UsageError as e:
        blob = path.resolve()  # the snapshot entry is a link to a blob named by its hash
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        msg = str(e).replace(str(blob), f"{spec.repo}/{name}").replace(str(path), f"{spec.repo}/{name}")
        raise UsageError(f"{msg} (it was removed from the hub cache)") from None
