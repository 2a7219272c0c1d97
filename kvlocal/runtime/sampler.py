"""Next-token choice on llama.cpp's sampler chain.

kvlocal runs its own decode loop, so it cannot use ``llama_sampler_sample`` (which reads the logits
of a context itself): the engine hands over the last logits vector, a :class:`Sampler` copies it into a
``llama_token_data_array`` and applies the chain with ``llama_sampler_apply``, then accepts the chosen
token so that the repeat penalty sees the history.

The chain is llama.cpp's default order (common/sampling.cpp): penalties, top-k, top-p, min-p,
temperature, then a seeded draw; with ``temp == 0`` it is penalties then greedy (exact argmax when the
penalty is off). Parameter names and defaults are llama.cpp's, except ``temp``: 0 (greedy) here,
0.8 in llama.cpp's tools, so that a run is reproducible unless asked otherwise.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from kvlocal.runtime.library import llama_lib

class SamplerParamError(ValueError):
    """A sampling parameter outside its range; ``param`` is its name (llama.cpp's)."""

    def __init__(self, param: str, rule: str, value):
        super().__init__(f"{param} must be {rule} (got {value})")
        self.param, self.rule, self.value = param, rule, value


def _check(param: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise SamplerParamError(param, rule, value)


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
        _check("temp", self.temp, self.temp >= 0, ">= 0")
        _check("top_k", self.top_k, self.top_k >= 0, ">= 0")
        _check("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]")
        _check("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]")
        _check("repeat_penalty", self.repeat_penalty, self.repeat_penalty > 0, "> 0")
        _check("repeat_last_n", self.repeat_last_n, self.repeat_last_n >= 0, ">= 0")
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
        # the samplers sort and truncate the array in place: refill all of it every time (as int32 columns:
        # three times faster than a structured dtype's fields, 0.7 ms for Gemma's 262k tokens)
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
