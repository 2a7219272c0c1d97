"""Chat templates: the GGUF's Jinja template first, llama.cpp's built-ins as the fallback, on real files."""

import re

import pytest

from conftest import run_cli
from kvlocal.errors import UsageError
from kvlocal.runtime import Model
from kvlocal.runtime import chat_template as ct

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany?"},
]


@pytest.fixture
def fresh_notes(monkeypatch):
    """Forget the notes already printed in this process, so a test sees its own."""
    monkeypatch.setattr(ct, "_noted", set())


_loaded: dict = {}


def model_of(request, fixture: str) -> Model:
    """The model of a fixture (a path), loaded once per test module."""
    if fixture not in _loaded:
        _loaded[fixture] = Model(request.getfixturevalue(fixture))
    return _loaded[fixture]


@pytest.fixture(params=["smollm2", "qwen"])
def chatml_model(request):
    return model_of(request, request.param)


@pytest.fixture
def gemma3_model(request):
    return model_of(request, "gemma3")


@pytest.mark.parametrize("add_assistant", [True, False])
def test_jinja_and_llama_cpp_agree_on_the_turns(chatml_model, add_assistant):
    """SmolLM2 and Qwen2.5 carry ChatML Jinja templates: with a system message both paths write the same
    text; without one the Jinja template adds its model's default system message, llama.cpp does not."""
    tmpl = ct.chat_template(chatml_model)
    assert tmpl.jinja and tmpl.builtin == tmpl.jinja  # llama.cpp gets the text to recognise
    assert tmpl.render_jinja(CONVERSATION, add_assistant) == tmpl.render_llama(CONVERSATION, add_assistant)
    turns = CONVERSATION[1:]
    jinja, llama = tmpl.render_jinja(turns, add_assistant), tmpl.render_llama(turns, add_assistant)
    assert jinja.endswith(llama)
    default = jinja[: len(jinja) - len(llama)]
    assert re.fullmatch(r"<\|im_start\|>system\n[^<]+<\|im_end\|>\n", default), default
    assert chatml_model.chat_prompt(turns, add_assistant) == jinja  # Jinja is the first choice


@pytest.mark.parametrize("fixture", ["smollm2", "qwen", "gemma3"])
def test_a_turn_extends_the_text_before_it(request, fixture):
    """What Turns relies on to feed only the new turn: the conversation rendered after a reply starts
    with the text rendered before it plus the reply."""
    model = model_of(request, fixture)
    first = model.chat_prompt(CONVERSATION[1:2])
    assert model.chat_prompt(CONVERSATION[1:]).startswith(first + CONVERSATION[2]["content"])


def test_gemma3_without_a_template_uses_llama_cpp_gemma(gemma3, fresh_notes, capsys):
    model = Model(gemma3)  # its own: the note comes with a model's first render
    assert model.meta("general.architecture") == "gemma3"
    tmpl = ct.chat_template(model)
    assert tmpl.jinja is None and tmpl.builtin == "gemma"
    assert model.chat_prompt(CONVERSATION) == ("<start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
                                               "<start_of_turn>model\nParis.<end_of_turn>\n"
                                               "<start_of_turn>user\nAnd of Germany?<end_of_turn>\n<start_of_turn>model\n")
    model.chat_prompt(CONVERSATION[1:2])
    note = f"kvlocal: {gemma3.name} has no chat template; using llama.cpp's built-in 'gemma' template\n"
    assert capsys.readouterr().err == note  # once
    # no <bos> in the text: the tokenizer adds it, once
    tokens = model.tokenize(model.chat_prompt(CONVERSATION[1:2]), add_special=True, parse_special=True)
    assert tokens[:2] == [model.tokenize("", add_special=True)[0], model.tokenize("<start_of_turn>", False, True)[0]]


# Gemma's format written as a Jinja template, as an instruction-tuned Gemma file carries one: BOS, the
# system message folded into the first user turn, "model" for the assistant
GEMMA_STYLE = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}{% set prefix = messages[0].content + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' }}"
    "{{ (prefix if loop.first else '') + m.content | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def test_gemma_fallback_writes_what_a_gemma_template_would(gemma3_model):
    model = gemma3_model
    as_jinja = ct.ChatTemplate("gemma-style", GEMMA_STYLE, None, bos_token="<bos>", strip_bos=True)
    for add_assistant in (True, False):
        assert as_jinja.render(CONVERSATION, add_assistant) == model.chat_prompt(CONVERSATION, add_assistant)
    keep_bos = ct.ChatTemplate("gemma-style", GEMMA_STYLE, None, bos_token="<bos>", strip_bos=False)
    assert keep_bos.render(CONVERSATION).startswith("<bos><start_of_turn>user\n")  # the control


@pytest.mark.parametrize("broken", ["{{ raise_exception('no system messages') }}", "{% for m in messages %}", "{{ 1 / 0 }}"])
def test_a_failing_jinja_template_falls_back_to_llama_cpp(broken, fresh_notes, capsys):
    tmpl = ct.ChatTemplate("broken.gguf", broken, "chatml")
    assert tmpl.render(CONVERSATION) == tmpl.render_llama(CONVERSATION)
    assert tmpl.render(CONVERSATION).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvlocal: the chat template of broken.gguf failed (") and "using llama.cpp's" in err[0]
    with pytest.raises(UsageError, match="the chat template of broken.gguf failed"):
        ct.ChatTemplate("broken.gguf", broken, None).render(CONVERSATION)


def test_builtin_by_architecture(request):
    assert ct.builtin_template(model_of(request, "smollm2")) == "chatml"  # llama architecture, no Llama 3 header token
    assert ct.builtin_template(model_of(request, "qwen")) == "chatml"
    assert ct.builtin_template(model_of(request, "gemma3")) == "gemma"
    names = ct.builtin_names()
    assert {"chatml", "gemma", "llama3", "phi3"} <= set(names)
    assert all(name in names for names_ in ct.BUILTIN_BY_ARCH.values() for name in names_)


def test_gemma3_chats(gemma3):
    """The whole path: the file has no template, the built-in one is said once, the chat runs. (Gemma 3
    270M is the pretrained model, not the instruction-tuned one: what it answers is not tested.)"""
    r = run_cli("chat", str(gemma3), "-c", "256", "-n", "8", input="What is the capital of France?\nAnd of Germany?\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("has no chat template; using llama.cpp's built-in 'gemma' template") == 1
    assert r.stdout.strip()


# ChatML that keeps only the first 8 characters of earlier replies, as templates that drop a reply's
# thoughts do: the text rendered after a reply no longer starts with what the cache was fed. And, as
# SmolLM2's and Qwen's, a default system message: the new turn rendered alone would repeat it.
CUTS_REPLIES = (
    "{% if messages[0].role != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
    "{{ m.content[:8] if m.role == 'assistant' else m.content }}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def text_of(model: Model, tokens) -> str:
    return b"".join(model.token_bytes(t, special=True) for t in tokens).decode()


def test_session_appends_only_the_new_turn_when_the_template_rewrites_earlier_ones(smollm2):
    from kvlocal.engine import Engine
    from kvlocal.runtime import Sampler
    from kvlocal.chat.turns import Turns

    model = Model(smollm2)
    ct._templates[model] = ct.ChatTemplate("cuts-replies", CUTS_REPLIES, "chatml")
    session = Turns(Engine(model, 1.0, "full", max_tokens=512), Sampler())
    fed = []
    append = session.engine.append
    session.engine.append = lambda tokens, probe=None, progress=None, **kw: fed.append(text_of(model, tokens)) or append(tokens, probe, progress, **kw)
    first = "".join(session.ask("What is the capital of Germany?", max_tokens=24))
    assert "Berlin" in first and len(first) > 8
    assert fed[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # the default system message
    second = "".join(session.ask("And what is the capital of Italy?", max_tokens=24))
    assert fed[1] == "<|im_start|>user\nAnd what is the capital of Italy?<|im_end|>\n<|im_start|>assistant\n"
    assert "Rome" in second
