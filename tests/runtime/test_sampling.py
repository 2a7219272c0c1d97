"""The sampler on llama.cpp's chain, measured over many draws on made-up logits vectors."""

from collections import Counter

import numpy as np
import pytest

from kvlocal.runtime import Sampler, SamplerParamError

# p = 1/2, 1/4, 1/8, ... over the first tokens, the rest far below
HALVING = np.full(1000, -30.0, dtype=np.float32)
HALVING[:10] = np.log(0.5 ** np.arange(1, 11))
OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every truncation off


def draws(sampler: Sampler, logits: np.ndarray, n: int = 2000) -> Counter:
    return Counter(sampler(logits) for _ in range(n))


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    greedy = Sampler()
    for n_vocab in (7, 1000, 49152):
        for _ in range(20):
            logits = rng.normal(size=n_vocab).astype(np.float32) * 5
            assert greedy(logits) == int(np.argmax(logits))
    tie = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert greedy(tie) == 1  # the first of equal maxima, as np.argmax


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(1)
    hot = Sampler(temp=2.0, top_k=1, top_p=1.0, min_p=0.0, seed=3)
    for _ in range(50):
        logits = rng.normal(size=500).astype(np.float32)
        assert hot(logits) == int(np.argmax(logits))


def test_same_seed_same_tokens_other_seed_other_tokens():
    flat = np.zeros(100, dtype=np.float32)
    a, b, c = (Sampler(temp=1.0, seed=s, **OFF) for s in (7, 7, 8))
    seq_a, seq_b, seq_c = ([s(flat) for _ in range(200)] for s in (a, b, c))
    assert seq_a == seq_b
    assert seq_a != seq_c
    assert len(set(seq_a)) > 50  # and it does draw: 200 draws over 100 equal tokens
    unseeded = [Sampler(temp=1.0, **OFF) for _ in range(2)]
    assert [unseeded[0](flat) for _ in range(50)] != [unseeded[1](flat) for _ in range(50)]


def test_temperature_draws_follow_softmax():
    counts = draws(Sampler(temp=1.0, seed=0, **OFF), HALVING, 4000)
    for tok, p in enumerate([0.5, 0.25, 0.125]):
        assert abs(counts[tok] / 4000 - p) < 0.03, (tok, counts[tok])
    sharp = draws(Sampler(temp=0.25, seed=0, **OFF), HALVING, 1000)
    assert sharp[0] > 900  # p ∝ 2^-4k: token 0 has 15/16 of the mass


@pytest.mark.parametrize("params,support", [
    (dict(OFF, min_p=0.2), {0, 1, 2}),  # p >= 0.2 · 0.5
    (dict(OFF, min_p=0.3), {0, 1}),
    (dict(OFF, top_p=0.8), {0, 1, 2}),  # 0.5 + 0.25 < 0.8 <= 0.875
    (dict(OFF, top_p=0.7), {0, 1}),
    (dict(OFF, top_k=3), {0, 1, 2}),
    (OFF, set(range(10))),  # the control: with nothing cut, the tail is drawn too
])
def test_truncation_restricts_the_support(params, support):
    counts = draws(Sampler(temp=1.0, seed=0, **params), HALVING, 4000)
    assert set(counts) == support, counts


def test_repeat_penalty_avoids_the_token_just_seen():
    logits = np.array([0.0, 2.0, 1.9, 0.5], dtype=np.float32)
    assert Sampler(repeat_penalty=1.5)(logits) == 1  # nothing seen yet
    seen = Sampler(repeat_penalty=1.5)
    seen.accept(1)
    assert seen(logits) == 2  # 2.0 / 1.5 < 1.9
    assert seen(logits) == 1  # 2 was chosen, so accepted: both penalized, 2.0 / 1.5 > 1.9 / 1.5
    off = Sampler(repeat_penalty=1.0)
    off.accept(1)
    assert off(logits) == 1  # the control: no penalty, no change
    short = Sampler(repeat_penalty=1.5, repeat_last_n=1)
    short.accept(1)
    short.accept(3)
    assert short(logits) == 1  # 1 is out of the last-1 window


def test_bad_parameters_name_themselves():
    for params, name in [(dict(temp=-1), "temp"), (dict(top_k=-1), "top_k"), (dict(top_p=0), "top_p"),
                         (dict(min_p=1.5), "min_p"), (dict(repeat_penalty=0), "repeat_penalty"),
                         (dict(repeat_last_n=-1), "repeat_last_n"), (dict(seed=-1), "seed")]:
        with pytest.raises(SamplerParamError, match=f"^{name} must be") as e:
            Sampler(**params)
        assert e.value.param == name


def test_close_frees_once():
    s = Sampler(temp=0.7, seed=1)
    assert 0 <= s(np.zeros(10, dtype=np.float32)) < 10
    s.close()
    assert not s._chain  # freed, and forgotten: a second close frees nothing twice
    s.close()
    assert not s._chain
