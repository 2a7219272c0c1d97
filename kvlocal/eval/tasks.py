"""Seeded, offline evaluation tasks over real text.

Every task turns (model, context length, seed) into a few :class:`Item`s: a prompt of about
``n_tokens`` tokens of real prose (the texts the package ships: the openings of *Pride and Prejudice*
and *A Tale of Two Cities*, and the GPL-3 text; a document longer than those draws on the first volume
of *Persuasion* too), the question at its end, and how an answer is scored.
The same seed gives the same items on every machine; different seeds start the text elsewhere and draw
other keys, names and depths.

Prompts are plain completions (no chat template), so instruction-tuned and pretrained models are asked
the same way: the prompt ends with the beginning of the answer ("... the pass code of the red door is").
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache, partial
from importlib import resources
from typing import Callable

from kvlocal.errors import UsageError

TEXTS = ("data/sample.txt", "data/gpl-3.0.txt")
LONG_TEXTS = TEXTS + ("data/persuasion-1.txt",)  # for documents the short texts cannot hold (~8K tokens)

def sample_text() -> str:
    """A few paragraphs of public-domain English prose shipped with kvlocal (Austen, Melville, Dickens)."""
    return resources.files("kvlocal").joinpath("data/sample.txt").read_text(encoding="utf-8")


@dataclass
class Item:
    """One prompt of a task. ``kind`` says how :func:`score` reads a reply: ``contains`` (any expected
    string in it), ``recall`` (the fraction of expected strings in it), ``prefix`` (the fraction of the
    expected words the reply starts with, in order), ``continuation`` (no reply: ``forced`` is the real
    text that follows the prompt, scored by agreement with the full cache)."""

    task: str
    name: str  # what varies within the task: a depth, the key asked, a part of the document
    document: str  # the text before the question
    question: str  # the end of the prompt: the question and the start of the answer ("" for continuation)
    expected: list[str] = field(default_factory=list)
    kind: str = "contains"
    n_generate: int = 12
    forced: str = ""  # continuation: the text after the prompt
    turns: list[tuple[str, str]] = field(default_factory=list)  # chat: (question, expected) asked in turn
    # chat: every fact of the document as (key, value, sentence as inserted), in document order — the values a
    # reply may give instead of the asked one (:func:`verdict`), and what tools look for in the tokens
    facts: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def prompt(self) -> str:
        return self.document + self.question


# -- real text ------------------------------------------------------------------------------------------

@lru_cache(maxsize=2)
def sentences(texts: tuple[str, ...] = TEXTS) -> tuple[str, ...]:
    """The texts as one cyclic sequence of sentences (a paragraph break is kept as a leading newline pair
    of the next sentence, so joining them gives back readable prose)."""
    out = []
    for name in texts:
        text = resources.files("kvlocal").joinpath(name).read_text()
        for para in re.split(r"\n\s*\n", text):
            words = " ".join(para.split())
            if not words:
                continue
            parts = re.split(r"(?<!Mr\.)(?<!Mrs\.)(?<!Dr\.)(?<=[.!?;:])\s+(?=[A-Z0-9\"(])", words)
            out.append("\n\n" + parts[0])
            out += [" " + p for p in parts[1:]]
    return tuple(out)


class Prose:
    """Real sentences for a model's tokenizer: :meth:`take` gives consecutive sentences from a seeded
    start that add up to about ``n_tokens`` tokens — from the short texts wherever they hold that many
    (so every document of an earlier release is drawn the same), else from the long ones."""

    def __init__(self, count_tokens: Callable[[str], int]):
        self.count = lru_cache(maxsize=None)(count_tokens)

    def pool(self, n_tokens: int) -> tuple[str, ...]:
        short = sentences(TEXTS)
        return short if n_tokens <= sum(self.count(s) for s in short) else sentences(LONG_TEXTS)

    def take(self, n_tokens: int, rng: random.Random) -> list[str]:
        pool = self.pool(n_tokens)
        i, out, total = rng.randrange(len(pool)), [], 0
        while total < n_tokens:
            s = pool[i % len(pool)]
            out.append(s.lstrip() if not out else s)
            total += self.count(s)
            i += 1
            if len(out) > len(pool):  # (never repeated: a repeat is easy to retrieve and not real prose)
                have = sum(self.count(x) for x in pool)
                raise UsageError(f"--tokens: a document of {n_tokens:,} tokens does not fit in the shipped texts "
                                 f"({have:,} tokens for this model's tokenizer): give fewer --tokens")
        return out


def insert_at(parts: list[str], facts: list[tuple[float, str]]) -> str:
    """Join sentences with each fact inserted at its depth (0 = before the first sentence, 1 = after the
    last), as a sentence of its own."""
    parts = list(parts)
    for depth, fact in sorted(facts, key=lambda f: -f[0]):
        at = round(depth * len(parts))
        parts.insert(at, " " + fact if at else fact + " ")
    return "".join(parts)


# -- tasks -----------------------------------------------------------------------------------------------

COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown"]
QUESTION_ROOM = 40  # tokens kept free for the question and answer prefix


def _code(rng: random.Random) -> str:
    return str(rng.randrange(10000, 100000))


def needle(prose: Prose, n_tokens: int, rng: random.Random, depths=(0.5, 0.1, 0.9)) -> list[Item]:
    """One fact at several depths of the text; the question asks for it."""
    items = []
    for depth in depths:
        color, code = rng.choice(COLORS), _code(rng)
        fact = f"The pass code of the {color} door is {code}."
        doc = insert_at(prose.take(n_tokens - QUESTION_ROOM, rng), [(depth, fact)])
        q = f"\n\nQuestion: What is the pass code of the {color} door?\nAnswer: The pass code of the {color} door is"
        items.append(Item("needle", f"depth={depth:g}", doc, q, [code]))
    return items


def multikey(prose: Prose, n_tokens: int, rng: random.Random, n_keys: int = 4, n_items: int = 3) -> list[Item]:
    """Several facts of the same form (pass codes of doors of different colours) at random depths; one is
    asked. Only a probe that knows the question can tell which one matters."""
    items = []
    for j in range(n_items):
        colors, codes, facts = _door_facts(rng, n_keys)
        ask = rng.randrange(n_keys)
        doc = insert_at(prose.take(n_tokens - QUESTION_ROOM - 12 * n_keys, rng), facts)
        q = (f"\n\nQuestion: What is the pass code of the {colors[ask]} door?\n"
             f"Answer: The pass code of the {colors[ask]} door is")
        items.append(Item("multikey", f"key {ask + 1}/{n_keys} at {facts[ask][0]:.2f}", doc, q, [codes[ask]]))
    return items


def _door_facts(rng: random.Random, n_keys: int) -> tuple[list[str], list[str], list[tuple[float, str]]]:
    """Colours, codes and facts ("The pass code of the red door is 48213.") at sorted random depths."""
    colors = rng.sample(COLORS, n_keys)
    codes = [_code(rng) for _ in colors]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in colors)
    return colors, codes, [(d, f"The pass code of the {c} door is {k}.") for d, c, k in zip(depths, colors, codes)]


def multiturn(prose: Prose, n_tokens: int, rng: random.Random, n_keys: int = 4, n_asked: int = 3) -> list[Item]:
    """One chat (the model's chat template, :class:`~kvlocal.chat.turns.Turns`): the document with four
    door codes is the first turn, then three of the codes are asked in turns of their own, each scoring
    the cache with its own tokens. What the first questions keep decides what the later ones can find."""
    colors, codes, facts = _door_facts(rng, n_keys)
    doc = insert_at(prose.take(n_tokens - 120 - 12 * n_keys, rng), facts)
    turns = [(f"What is the pass code of the {colors[k]} door? Answer with the number only.", codes[k])
             for k in rng.sample(range(n_keys), n_asked)]
    return [Item("multiturn", f"{n_asked} questions", doc, "", [c for _, c in turns], kind="chat", n_generate=16,
                 turns=turns, facts=[(c, k, f) for c, k, (_, f) in zip(colors, codes, facts)])]


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(n))


@dataclass(frozen=True)
class FactTemplate:
    """One shape of fact for ``multifact``: a sentence and its question with a ``{key}`` (drawn from ``keys``)
    and a ``{value}`` (drawn by ``value``; every value of a template has the same length, so none is a
    substring of another, and at least 4 characters, so a reply holds one only by giving it)."""

    name: str
    fact: str
    question: str
    keys: tuple[str, ...]
    value: Callable[[random.Random], str]


FACT_TEMPLATES = (
    FactTemplate("order numbers", "The warehouse in {key} holds order number {value}.",
                 "Which order number does the warehouse in {key} hold? Answer with the order number only.",
                 ("Lisbon", "Oslo", "Tunis", "Quito", "Dakar", "Perth", "Porto", "Riga", "Lima", "Hanoi", "Cairo",
                  "Minsk", "Bergen", "Leeds", "Turin", "Kyoto"),
                 lambda rng: str(rng.randrange(100000, 1000000))),
    FactTemplate("office extensions", "The office extension of {key} is {value}.",
                 "What is the office extension of {key}? Answer with the extension only.",
                 ("Nadia Okafor", "Tomas Lindqvist", "Priya Raman", "Jonas Weber", "Leila Haddad", "Marco Bellini",
                  "Ingrid Solberg", "Kenji Arai", "Fatima Diallo", "Pavel Novak", "Rosa Medina", "Sean Brennan",
                  "Mei Chen", "Omar Farouk", "Hanna Virtanen", "Luis Ortega"),
                 lambda rng: str(rng.randrange(2000, 10000))),
    FactTemplate("budget codes", "The budget code of Project {key} is {value}.",
                 "What is the budget code of Project {key}? Answer with the code only.",
                 ("Heron", "Basalt", "Cobalt", "Juniper", "Falcon", "Granite", "Lantern", "Maple", "Nimbus", "Quartz",
                  "Saffron", "Tundra", "Willow", "Zephyr", "Atlas", "Ember"),
                 lambda rng: f"{_letters(rng, 2)}-{rng.randrange(100, 1000)}"),
    FactTemplate("call signs", "The ship {key} sails under the call sign {value}.",
                 "What is the call sign of the ship {key}? Answer with the call sign only.",
                 ("Aurora", "Kestrel", "Meridian", "Halcyon", "Seraphine", "Valkyrie", "Osprey", "Calypso", "Marlin",
                  "Tempest", "Albatross", "Nautilus", "Orion", "Pelican", "Corsair", "Wren"),
                 lambda rng: f"{_letters(rng, 2)}{rng.randrange(10)}{_letters(rng, 2)}"),
)


def multifact(prose: Prose, n_tokens: int, rng: random.Random, n_facts: int = 6, task: str = "multifact") -> list[Item]:
    """One chat, as ``multiturn``'s, over a document of about ``n_tokens`` holding ``n_facts`` facts of ONE
    template (:data:`FACT_TEMPLATES`: same sentence, other keys and values) spread evenly with jitter; then
    every fact is asked, in a shuffled order, one a turn. A cache that keeps the facts' shape but mixes up
    their keys answers with another fact's value (``confused``, :func:`verdict`)."""
    t = rng.choice(FACT_TEMPLATES)
    keys = rng.sample(t.keys, n_facts)
    slot = 0.9 / n_facts  # evenly spaced in [0.05, 0.95], each anywhere in the middle 80% of its slot
    depths = [0.05 + slot * (i + rng.uniform(0.1, 0.9)) for i in range(n_facts)]
    stand_in = t.value(random.Random(0))  # a value of the same shape: the facts' tokens, before their values
    parts = prose.take(n_tokens - sum(prose.count(" " + t.fact.format(key=k, value=stand_in)) for k in keys), rng)
    values = _distinct_values(t, rng, n_facts, "".join(parts))
    facts = [(k, v, t.fact.format(key=k, value=v)) for k, v in zip(keys, values)]
    doc = insert_at(parts, [(d, f) for d, (_, _, f) in zip(depths, facts)])
    order = rng.sample(range(n_facts), n_facts)
    turns = [(t.question.format(key=keys[i]), values[i]) for i in order]
    return [Item(task, f"{n_facts} {t.name}", doc, "", [v for _, v in turns], kind="chat", n_generate=16,
                 turns=turns, facts=facts)]


def _distinct_values(t: FactTemplate, rng: random.Random, n: int, text: str) -> list[str]:
    """``n`` different values of a template, none already in the text (a year in the prose is no extension)."""
    values: list[str] = []
    while len(values) < n:
        v = t.value(rng)
        if v not in values and v not in text:
            values.append(v)
    return values


def _var(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def vartrack(prose: Prose, n_tokens: int, rng: random.Random, hops: int = 3, n_items: int = 2) -> list[Item]:
    """Variable tracking (as in RULER): a chain ``VAR A = 12345. VAR B = VAR A. ...`` spread over the text,
    with a distractor chain holding another value; the question asks which variables hold the value.
    Scored by the fraction of the chain's names in the reply."""
    items = []
    for j in range(n_items):
        names = [_var(rng) for _ in range(2 * hops)]
        chain, other = names[:hops], names[hops:]
        value, decoy = _code(rng), _code(rng)
        facts = []
        for vars_, val in ((chain, value), (other, decoy)):
            depths = sorted(rng.uniform(0.05, 0.95) for _ in vars_)
            facts += [(depths[0], f"VAR {vars_[0]} = {val}.")]
            facts += [(d, f"VAR {b} = VAR {a}.") for d, a, b in zip(depths[1:], vars_, vars_[1:])]
        doc = insert_at(prose.take(n_tokens - QUESTION_ROOM - 12 * 2 * hops, rng), facts)
        q = (f"\n\nQuestion: Which variables are assigned the value {value}, directly or through other variables?\n"
             f"Answer: The variables assigned the value {value} are: VAR")
        items.append(Item("vartrack", f"chain {j + 1}", doc, q, chain, kind="recall", n_generate=24))
    return items


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def docqa(prose: Prose, n_tokens: int, rng: random.Random, parts=(("start", 0.1), ("middle", 0.5), ("end", 0.85))) -> list[Item]:
    """Questions about one real document's start, middle and end: the opening words of a sentence there
    are quoted and the model must go on with the text's own next words (checked word by word)."""
    sents = prose.take(n_tokens - QUESTION_ROOM - 20, rng)
    doc = "".join(sents)
    items = []
    for part, depth in parts:
        i = round(depth * len(sents))
        # the nearest sentence long enough to quote 6 words and check the next 4
        for k in sorted(range(len(sents)), key=lambda k: abs(k - i)):
            words = sents[k].split()
            if len(words) >= 12:
                break
        else:
            raise ValueError("no sentence of 12 words or more in the text")
        quote, rest = " ".join(words[:6]), " ".join(words[6:10])
        q = f'\n\nQuestion: How does the sentence that begins "{quote}" go on in the text above?\nAnswer: {quote}'
        items.append(Item("docqa", part, doc, q, [rest], kind="prefix"))
    return items


def continuation(prose: Prose, n_tokens: int, rng: random.Random, n_forced: int = 64) -> list[Item]:
    """Real text read up to a point, then the real text that follows is forced token by token: the next-
    token distributions are compared with the full cache's (mean KL, greedy agreement)."""
    sents = prose.take(n_tokens + 2 * n_forced, rng)
    cut = len(sents)
    while cut > 1 and sum(prose.count(s) for s in sents[cut - 1:]) < 1.5 * n_forced:
        cut -= 1
    # the loop above can leave the forced part short (empty when the last sentence is long, as the GPL's are);
    # move the cut back until it has n_forced tokens (items that had them are unchanged)
    while cut > 1 and sum(prose.count(s) for s in sents[cut:]) < n_forced:
        cut -= 1
    doc, rest = "".join(sents[:cut]), "".join(sents[cut:])
    return [Item("continuation", "next", doc, "", [], kind="continuation", n_generate=0, forced=rest)]


N_GENERATED = 768  # generation: tokens forced through the decode loop (past two compressions at 0.1 of 4K)


def generation(prose: Prose, n_tokens: int, rng: random.Random, n_forced: int = N_GENERATED) -> list[Item]:
    """About ``n_tokens`` of real text read, then the ``n_forced`` tokens that follow it forced through the
    engine's own generation loop (the runner's): the cache fills again while it is written, so the
    compressions of generation — never inside ``continuation``'s 64 tokens — fall inside it. Scored as
    ``continuation`` is (KL against the full cache, greedy agreement)."""
    sents = prose.take(n_tokens + 2 * n_forced, rng)
    cut, total = 0, 0
    while cut < len(sents) - 1 and total < n_tokens:
        total += prose.count(sents[cut])
        cut += 1
    doc, rest = "".join(sents[:cut]), "".join(sents[cut:])
    return [Item("generation", "next", doc, "", [], kind="continuation", n_generate=0, forced=rest)]


TASKS: dict[str, Callable[..., list[Item]]] = {
    "needle": needle,
    "multikey": multikey,
    "vartrack": vartrack,
    "docqa": docqa,
    "continuation": continuation,
    "multiturn": multiturn,
    "generation": generation,
    "multifact": multifact,
    "multifact12": partial(multifact, n_facts=12, task="multifact12"),
}
GENERATION_TASKS = ("generation",)  # scored as continuation is, forced through the decode loop (the runner)
KL_TASKS = ("continuation",) + GENERATION_TASKS  # scored against the full cache's distributions (KL, agreement)
CHAT_TASKS = ("multiturn", "multifact", "multifact12")  # asked in a chat session: the turns are the probe ("chat")


def make_items(task: str, prose: Prose, n_tokens: int, seed: int) -> list[Item]:
    """A task's items for a seed: the same on every run (a private RNG per task and seed)."""
    return TASKS[task](prose, n_tokens, random.Random(f"{task}:{seed}:{n_tokens}"))


def score(item: Item, reply: str) -> float:
    """The score of a reply in [0, 1] (``continuation`` items are scored by the runner)."""
    if item.kind == "contains":
        return float(any(e in reply for e in item.expected))
    if item.kind == "recall":
        return sum(e in reply for e in item.expected) / len(item.expected)
    if item.kind == "prefix":
        want, got = _words(item.expected[0]), _words(reply)
        n = 0
        while n < len(want) and n < len(got) and want[n] == got[n]:
            n += 1
        return n / len(want)
    raise ValueError(f"item kind {item.kind!r} is not scored from a reply")


VERDICTS = ("answered", "confused", "missed")


def verdict(item: Item, expected: str, reply: str) -> str:
    """A chat turn's verdict: ``answered`` (the asked value is in the reply), ``confused`` (it is not, but
    another fact's value of the same document is: a fact mixed up with one of the same shape), else
    ``missed``."""
    if expected in reply:
        return "answered"
    return "confused" if any(v in reply for _, v, _ in item.facts if v != expected) else "missed"


def shares(verdicts: list[str]) -> dict[str, float]:
    """The share of each of :data:`VERDICTS` in a chat's turns (they add up to 1)."""
    return {v: verdicts.count(v) / len(verdicts) for v in VERDICTS}


REPLY_LOOP = (3, 3)  # a short reply loops when one span of 3 tokens occurs 3 times in it


def loops(tokens: list[int], span: int = REPLY_LOOP[0], times: int = REPLY_LOOP[1]) -> bool:
    """Whether a short reply (a chat turn's 16 tokens) loops: one span of ``span`` tokens occurs ``times``
    times in it ("The pass code of the pass code of the pass code of", "4444444"). The chat's
    :class:`~kvlocal.engine.loops.LoopGuard` needs its window to be one span repeated 4 times or more — 16
    tokens hold that only for spans of 1-3 tokens, and a compressed cache's loops in a short reply are
    longer."""
    grams = Counter(tuple(tokens[i:i + span]) for i in range(len(tokens) - span + 1))
    return bool(grams) and max(grams.values()) >= times
