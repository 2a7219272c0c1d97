"""The registry of compression methods (kvlocal.compress.methods): every method against its PyTorch twin, and a new
method added as one scorer file plus its twin, run through the engine and the eval runner on a real model.

The tests here are parametrised over the registry itself (``METHODS``), not over a list of names: a method added
to kvlocal.compress is tested here without an edit to this file.
"""

import textwrap

import numpy as np
import pytest
from policy import need

torch = need("torch")  # the PyTorch twins: skip locally, fail under CI

import kvlocal.compress  # noqa: E402
import kvlocal.errors  # noqa: E402
import kvlocal.reference.compress  # noqa: E402
from kvlocal.compress import METHODS, make_scorer, method_params  # noqa: E402
from kvlocal.reference.compress import make_twin  # noqa: E402
from test_compress import N_SINK, assert_same_keep, make_case  # noqa: E402


def test_every_method_has_its_twin():
    """The twins are declared by name in kvlocal/reference/compress, as the methods are in kvlocal/compress."""
    assert set(kvlocal.reference.compress.METHODS) == set(METHODS)
    assert list(METHODS)[0] == "full"  # the listing (help text, errors) starts from the baseline


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_builds_its_twin_and_takes_its_parameters(method):
    make_twin(method, N_SINK)


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_builds_with_its_parameters_and_refuses_others(method):
    scorer = make_scorer(method)
    for name in method_params(method):  # each parameter it lists is one a scorer in it holds
        parts, found = [scorer], False
        while parts:
            part = parts.pop()
            found |= hasattr(part, name)
            parts += [getattr(part, p) for p in ("press", "merger") if hasattr(part, p)]
        assert found, f"{method}: {name}"
    with pytest.raises(kvlocal.errors.UsageError, match="no parameter"):
        make_scorer(method, no_such_parameter=1)


def evicting(method: str) -> bool:
    """Its plans keep the same number of whole rows per head: no merges, no head budgets."""
    scorer = make_scorer(method)
    return not (scorer.merges or scorer.needs_bias)


@pytest.mark.parametrize("method", [m for m in METHODS if evicting(m)])
def test_each_evicting_method_keeps_what_its_twin_keeps(method):
    """Each evicting method against its twin's ``plan``, on the cases of tests/compress/test_compress.py (the merging and
    head-budget methods, whose plans differ in shape, are compared with theirs in tests/compress/test_compress_merge.py)."""
    mine, twin = make_scorer(method), make_twin(method, N_SINK)
    for seed, queries in ((0, "tail"), (1, "inside")):
        layer, kv, obs = make_case(seed=seed, queries=queries, n=60)
        for budget in (14, 30, 59):
            assert_same_keep(mine.keep(layer, budget), layer, twin.plan(kv, obs, budget), f"{method} b={budget}")


# -- a new method: one scorer file and its twin ----------------------------------------------------------------
TOY = '''
"""Oldest: keep the sinks, the window and then the oldest cells (a toy method for tests/compress/test_methods.py)."""
from dataclasses import dataclass

import numpy as np

from kvlocal.compress.base import LayerInputs, Scorer
from kvlocal.compress.methods import Method

CALLS = []  # the layers it scored


@dataclass
class Oldest(Scorer):
    def score(self, layer: LayerInputs) -> np.ndarray:
        CALLS.append(layer.n)
        scores = np.where(layer.protected(), np.inf, -layer.pos_h.astype(np.float32))
        return np.where(layer.live, scores, -np.inf).astype(np.float32)


METHODS = {"toy": Method(Oldest)}
'''

TOY_TWIN = '''
"""The PyTorch twin of the toy method Oldest."""
import math
from dataclasses import dataclass

import torch

from kvlocal.reference.compress.base import Scorer, live_mask, protected_mask


@dataclass
class Oldest(Scorer):
    n_sink: int = 4

    def score(self, kv, obs=None):
        scores = -kv.pos.to(torch.float32)
        scores = scores.masked_fill(protected_mask(kv, self.n_sink, None if obs is None else obs.q_pos), math.inf)
        return scores.masked_fill(~live_mask(kv), -math.inf)


METHODS = {"toy": lambda n_sink: Oldest(n_sink=n_sink)}
'''


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    """The toy method added as kvlocal/compress/toy.py and its twin kvlocal/reference/compress/toy.py — written in
    a temporary folder that each package's ``__path__`` also searches (as for a file in the folder itself), so
    the tree is not touched. Yields the files written; the registries are read again afterwards without it."""
    files = {tmp_path / "compress" / "toy.py": TOY, tmp_path / "reference" / "compress" / "toy.py": TOY_TWIN}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    monkeypatch.setattr(kvlocal.compress, "__path__", [*kvlocal.compress.__path__, str(tmp_path / "compress")])
    monkeypatch.setattr(kvlocal.reference.compress, "__path__",
                        [*kvlocal.reference.compress.__path__, str(tmp_path / "reference" / "compress")])
    kvlocal.compress.discover()
    kvlocal.reference.compress.discover()
    yield sorted(files)
    monkeypatch.undo()
    kvlocal.compress.discover()
    kvlocal.reference.compress.discover()


@pytest.mark.slow(7)
def test_a_new_method_is_one_scorer_file_and_its_twin(toy_method, smollm2, smollm2_model):
    """Two files make a method: its name is listed (help text, errors), its twin keeps the same cells, and it
    compresses a real model's cache in the engine on both KV backends, in a chat, in the server (a request's
    ``kv.method``) and in the eval runner."""
    import sys

    from serving import in_process_server

    try:
        import httpx
    except ImportError:  # the `openai` client's HTTP library (a fork with httpx's API)
        import httpx2 as httpx

    import kvlocal
    from kvlocal.cli.repl import help_text
    from kvlocal.engine import Engine
    from kvlocal.eval.runner import Runner, Spec

    assert [p.name for p in toy_method] == ["toy.py", "toy.py"] and len(toy_method) == 2
    assert "toy" in METHODS and "toy" in help_text() and method_params("toy") == []
    with pytest.raises(kvlocal.errors.UsageError, match="toy"):
        make_scorer("h2o")  # the known methods an error lists
    layer, kv, obs = make_case(seed=0, n=60)
    assert_same_keep(make_scorer("toy").keep(layer, 30), layer, make_twin("toy", N_SINK).plan(kv, obs, 30), "toy")

    calls = sys.modules["kvlocal.compress.toy"].CALLS
    text = " ".join(f"Line {i} of the text." for i in range(30))
    tokens = smollm2_model.tokenize(text)
    for backend in ("state", "native"):
        calls.clear()
        eng = Engine(smollm2_model, 48, "toy", max_tokens=256, backend=backend)
        eng.prefill(tokens)
        assert len(tokens) > 150 and eng.stats.compression_events > 0 and calls, backend  # it scored each event
        assert eng.live_cells() < len(tokens) and list(eng.generate(4)), backend  # the compressed cache decodes
        eng.close()

    calls.clear()
    chat = kvlocal.Chat(smollm2_model, 48, "toy")
    reply = "".join(chat.send(text + " What is line 3?", max_tokens=4))
    assert isinstance(reply, str) and chat.stats.compression_events > 0 and calls
    chat.close()

    calls.clear()
    with in_process_server(smollm2_model, "smollm2-135m", max_tokens=4) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": text + " What is line 3?"}], "max_tokens": 4, "temperature": 0,
            "kv": {"method": "toy", "budget": 48}}).json()
    assert r["kv"]["method"] == "toy" and r["kv"]["compression_events"] > 0 and calls, r

    calls.clear()
    record = Runner("smollm2-135m", smollm2, n_threads=None).run(
        Spec("smollm2-135m", "needle", "toy", 0.1, "question", 0, 200), n_items=1)
    assert record["method"] == "toy" and record["compression_events"] > 0 and calls
    assert 0.0 <= record["score"] <= 1.0
