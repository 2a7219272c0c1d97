"""Next-token choice on llama.cpp's sampler chain.

kvlocal runs its own decode loop, so it cannot use ``llama_sampler_sample`` (which reads the logits
of a context itself): the engine hands over the last logits vector, a :class:`Sampler` copies it into a
``llama_token_data_array`` and applies the chain with ``llama_sampler_apply``, then accepts the chosen
token so that the repeat penalty sees the history.

The chain is llama.cpp's default order (common/sampling.cpp): penalties, top-k, top-p, min-p,
temperature, then a seeded draw; with ``temp == 0`` it is penalties then greedy (exact argmax when the
penalty is off). Parameter names are llama.cpp's. Two sets of defaults:

- ``Sampler()`` is greedy (``temp`` 0): what ``kvlocal run``, ``eval`` and ``bench`` use, so that a run is
  reproducible and compressed and full caches are compared on the same tokens;
- :func:`chat_sampling` is what the interactive front doors (``kvlocal chat``, ``serve``, :class:`kvlocal.Chat`)
  use: the sampling a GGUF declares for itself (its ``general.sampling.*`` keys), else llama.cpp's and
  Ollama's (:data:`CHAT_SAMPLING`). Greedy decoding sends small models into loops on everyday questions
  (docs/chat.md § Sampling defaults has the measurement).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from kvlocal.runtime.library import llama_lib

# The interactive front doors' defaults: llama.cpp's CLI and Ollama's (temperature, top-k, top-p, min-p), with
# Ollama's repeat penalty over its last 64 tokens (docs/chat.md § Sampling defaults: what it changes).
CHAT_SAMPLING = dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=64)

# A GGUF's own sampling (gguf-py's Keys.General.SAMPLING_*), by Sampler's parameter names
GGUF_SAMPLING_KEYS = {"temp": "general.sampling.temp", "top_k": "general.sampling.top_k",
                      "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
                      "repeat_penalty": "general.sampling.penalty_repeat",
                      "repeat_last_n": "general.sampling.penalty_last_n"}


def chat_sampling(model=None) -> dict:
    """Sampler keywords for a chat with ``model`` (a :class:`kvlocal.runtime.Model`, or None): :data:`CHAT_SAMPLING`
    with what the model's GGUF declares for itself in its ``general.sampling.*`` keys in their place (a value
    that does not parse, or is out of range, is ignored)."""
    params = dict(CHAT_SAMPLING)
    for name, key in GGUF_SAMPLING_KEYS.items():
        raw = model.meta(key) if model is not None else None
        if raw is None:
            continue
        try:
            value = int(float(raw)) if name in ("top_k", "repeat_last_n") else float(raw)
            check_param(name, value)
        except (ValueError, SamplerParamError):
            continue
        params[name] = value
    return params


class SamplerParamError(ValueError):
    """A sampling parameter outside its range; ``param`` is its name (llama.cpp's)."""

    def __init__(self, param: str, rule: str, value):
        super().__init__(f"{param} must be {rule} (got {value})")
        self.param, self.rule, self.value = param, rule, value


def _check(param: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise SamplerParamError(param, rule, value)


# each sampling parameter's range (the seed's depends on the library: Sampler checks it)
_RULES = {"temp": (lambda v: v >= 0, ">= 0"), "top_k": (lambda v: v >= 0, ">= 0"),
          "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
          "repeat_penalty": (lambda v: v > 0, "> 0"), "repeat_last_n": (lambda v: v >= 0, ">= 0")}
SAMPLING_PARAMS = tuple(_RULES)  # Sampler's parameters but the seed, in llama.cpp's flag order


def check_param(name: str, value) -> None:
    """SamplerParamError if ``value`` is out of range for the sampling parameter ``name``."""
    ok, rule = _RULES[name]
    _check(name, value, ok(value), rule)


@dataclass(eq=False)
class Sampler:
    """Picks the next token from a logits vector with llama.cpp's sampler chain.

    Parameters
    ----------
    temp: temperature; 0 = greedy (argmax after the repeat penalty).
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set whose probability reaches p (1 = off).
    min_p: drop tokens less likely than min_p times the most likely one (0 = off).
    repeat_penalty: divide the logits of tokens seen in the last ``repeat_last_n`` (1 = off).
    repeat_last_n: how many accepted tokens the repeat penalty looks back on (0 = off).
    seed: seed of the draw; None = a random seed (llama.cpp's LLAMA_DEFAULT_SEED).

    Not thread-safe; :meth:`close` (or garbage collection) frees the chain.
    """

    temp: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    _chain: object = field(default=None, init=False, repr=False)
    _data: np.ndarray | None = field(default=None, init=False, repr=False)  # [n_vocab, 3] int32: llama_token_data
    _ids: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        for name in SAMPLING_PARAMS:
            check_param(name, getattr(self, name))
        lib = llama_lib()
        _check("seed", self.seed, self.seed is None or 0 <= self.seed < lib.LLAMA_DEFAULT_SEED,
               f"in [0, {lib.LLAMA_DEFAULT_SEED}) or None (random)")
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        # n_vocab (0 here) is read only by on-device sampling, which a chain applied by hand never runs
        links = [lib.llama_sampler_init_penalties(0, self.repeat_last_n, self.repeat_penalty, 0.0, 0.0)]
        if self.temp <= 0:
            links.append(lib.llama_sampler_init_greedy())
        else:
            links += [
                lib.llama_sampler_init_top_k(self.top_k),
                lib.llama_sampler_init_top_p(self.top_p, 1),
                lib.llama_sampler_init_min_p(self.min_p, 1),
                lib.llama_sampler_init_temp(self.temp),
                lib.llama_sampler_init_dist(lib.LLAMA_DEFAULT_SEED if self.seed is None else self.seed),
            ]
        for s in links:
            lib.llama_sampler_chain_add(chain, s)  # the chain owns them from here
        self._chain = chain

    def __call__(self, logits: np.ndarray) -> int:
        """The chosen token for this logits vector [n_vocab]; accepted into the history."""
        lib = llama_lib()
        n = logits.shape[-1]
        if self._data is None or len(self._data) != n:
            self._data = np.empty((n, 3), dtype=np.int32)  # rows of {int32 id; float logit; float p;}
            self._ids = np.arange(n, dtype=np.int32)
        data = self._data
        # the samplers sort and truncate the array in place: refill all of it every time (as int32 columns, which
        # numpy fills faster than a structured dtype's fields)
        data[:, 0] = self._ids
        data[:, 1] = np.ascontiguousarray(logits, dtype=np.float32).view(np.int32)
        data[:, 2] = 0  # p = 0.0f
        cur = lib.llama_token_data_array(
            data=data.ctypes.data_as(lib.llama_token_data_p), size=n, selected=-1, sorted=False)
        lib.llama_sampler_apply(self._chain, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size:
            raise RuntimeError(f"llama.cpp's sampler chain selected no token ({cur.selected} of {cur.size})")
        token = int(cur.data[cur.selected].id)  # cur.data: the samplers may point it elsewhere
        self.accept(token)
        return token

    def describe(self) -> str:
        """One short phrase for a banner: ``greedy`` or ``temp 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat
        penalty 1.1, seed 7``."""
        parts = ["greedy"] if self.temp <= 0 else [f"temp {self.temp:g}", f"top-k {self.top_k}", f"top-p {self.top_p:g}",
                                                   f"min-p {self.min_p:g}"]
        if self.repeat_penalty != 1 and self.repeat_last_n:
            parts.append(f"repeat penalty {self.repeat_penalty:g}")
        if self.temp > 0:
            parts.append("random seed" if self.seed is None else f"seed {self.seed}")
        return ", ".join(parts)

    def accept(self, token: int) -> None:
        """Add a token to the history the repeat penalty looks at (e.g. the prompt's)."""
        llama_lib().llama_sampler_accept(self._chain, token)

    def close(self) -> None:
        if getattr(self, "_chain", None):
            llama_lib().llama_sampler_free(self._chain)
            self._chain = None

    __del__ = close


def top_probability(logits: np.ndarray) -> float:
    """The largest probability of the softmax of ``logits``."""
    z = np.asarray(logits, dtype=np.float64)
    return float(1.0 / np.exp(z - z.max()).sum())
