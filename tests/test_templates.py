"""Chat templates (exokv.model.templates): the built-ins, the fallback for a model without
one, stop sequences, --chat-template values and an ollama manifest's layers. No chat
runs here (tests/test_templates_chat.py runs them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf_helpers import write_gguf

from exokv.errors import UsageError
from exokv.model import templates
from exokv.model.templates import Format, Settled, fallback, read_choice, settle
from exokv.prompt.render import PromptRenderer
from exokv.rank.stops import TextStops

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": " Hi, how can I help?"},
    {"role": "user", "content": "what is a cache"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The builtin's tokenizer (chat tokens, no BOS) and a base GGUF's (neither, BOS)."""
    from exokv.model import builtin
    from exokv.model.resolve import load_model

    root = tmp_path_factory.mktemp("templates")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXOKV_HOME", str(root / "home"))
        mp.setenv("EXOKV_MODELS", str(root / "models"))
        src = builtin.ensure_builtin("tiny")
        base = write_gguf(src, root / "base.gguf", base=True)
        return {"chat": load_model("builtin:tiny")[1], "base": load_model(str(base))[1]}


@pytest.mark.parametrize("name", templates.NAMES)
def test_each_builtin_puts_a_reply_right_after_its_generation_prompt(
    tokenizers: dict[str, Any], name: str
) -> None:
    # What the renderer relies on to show the model its own reply tokens.
    settled = settle(tokenizers["chat"], "qwen2", name)
    renderer = PromptRenderer(tokenizers["chat"], settled.text)
    full = renderer._template(CONVERSATION)
    head = renderer._template(CONVERSATION[:2])
    assert full.startswith(head + CONVERSATION[2]["content"]), (head, full)
    assert "Be brief." in full and "what is a cache" in full
    assert full != renderer._template(CONVERSATION[1:])  # the system prompt is in it


def test_builtins_differ_and_name_their_end_of_turn_tokens(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["chat"]
    texts = {
        n: PromptRenderer(tok, settle(tok, None, n).text).render(CONVERSATION[1:])
        for n in templates.NAMES  # no system prompt: qwen gives its own, chatml none
    }
    assert len({tuple(t) for t in texts.values()}) == len(texts)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert settle(tok, None, "chatml").ends == (im_end,)
    assert settle(tok, None, "gemma").ends == ()  # not in this vocabulary: nothing to stop on
    assert settle(tok, None, "plain").stops == ("\nUser:",)


@pytest.mark.parametrize(
    ("family", "vocab", "name", "why"),
    [
        ("gemma3", {"<start_of_turn>": 1, "<end_of_turn>": 2}, "gemma", "architecture"),
        ("llama", {"<|start_header_id|>": 1, "<|eot_id|>": 2}, "llama3", "<|start_header_id|>"),
        ("qwen2", {"<|im_start|>": 1}, "chatml", "<|im_start|>"),
        ("mistral", {"[INST]": 3}, "mistral", "[INST]"),
        ("phi3", {"<|user|>": 3, "<|end|>": 4}, "phi", "<|user|>"),
        ("llama", {"<s>": 1, "</s>": 2}, "plain", "base model"),
        ("gemma3", {"<s>": 1}, "plain", "base model"),  # no gemma turn tokens: not gemma
    ],
)
def test_a_model_without_a_template_gets_one_as_llama_cpp_picks(
    family: str, vocab: dict[str, int], name: str, why: str
) -> None:
    chosen, reason = fallback(family, vocab)
    assert chosen == name and why in reason


def test_the_fallback_is_said_and_a_base_model_gets_the_plain_format_with_bos(
    tokenizers: dict[str, Any],
) -> None:
    base = tokenizers["base"]
    assert base.chat_template is None and templates.adds_bos(base)
    settled = settle(base, "qwen2", None)
    assert settled.name == "plain" and "base model" in settled.note and "plain" in settled.note
    tokens = PromptRenderer(base, settled.text).render(CONVERSATION)
    assert tokens[0] == base.bos_token_id and tokens.count(base.bos_token_id) == 1
    text = base.decode(tokens)
    assert text.endswith("User: what is a cache\nAssistant:"), text
    assert text.index("Be brief.") < text.index("User: hello there")
    # A template chosen for it gets BOS too; the model's own needs no line.
    assert PromptRenderer(base, settle(base, None, "chatml").text).render(CONVERSATION)[0] == (
        base.bos_token_id
    )
    own = settle(tokenizers["chat"], "qwen2", None)
    assert own == Settled("model", None) and not own.note
    assert (
        PromptRenderer(tokenizers["chat"], settle(tokenizers["chat"], None, "plain").text).render(
            CONVERSATION
        )[0]
        != base.bos_token_id
    )  # this tokenizer adds no BOS


def test_a_template_that_cannot_render_fails_in_one_line(tokenizers: dict[str, Any]) -> None:
    from exokv.errors import ExokvError

    with pytest.raises(ExokvError, match="cannot render a conversation"):
        settle(tokenizers["chat"], None, "{{ raise_exception('no system role') }}")


def test_stop_sequences_end_the_reply_and_keep_the_tokens_that_spell_it() -> None:
    stops = TextStops(["\nUser:"])
    texts = [" Hi", " Hi there", " Hi there\n", " Hi there\nUser", " Hi there\nUser:"]
    assert [stops.feed(t) for t in texts] == [False, False, False, False, True]
    assert stops.cut == len(" Hi there") and stops.reply(texts[-1]) == " Hi there"
    assert stops.kept([10, 11, 12, 13, 14]) == [10, 11]
    # Nothing that could begin a stop is shown before it is known not to be one.
    assert TextStops(["\nUser:"]).safe(" Hi there\nUs") == len(" Hi there\nUs") - 5
    inside = TextStops(["ere"])
    assert [inside.feed(t) for t in (" Hi", " Hi there")] == [False, True]
    assert inside.reply(" Hi there") == " Hi th" and inside.kept([1, 2]) == []
    none = TextStops([])
    assert not none and not none.feed("anything") and none.kept([1, 2]) == [1, 2]


def test_chat_template_values(tmp_path: Path) -> None:
    assert read_choice("chatml") == "chatml"
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_choice(str(good)) == good.read_text()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    for value, words in (
        ("chatml2", "not a built-in template (chatml, qwen, llama3"),
        (str(bad), "not a Jinja template (line 1"),
        (str(empty), "the template is empty"),
        (str(tmp_path), "cannot be read"),
    ):
        with pytest.raises(UsageError, match=None) as err:
            read_choice(value)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_the_prompt_format_crosses_the_command_line_as_one_word() -> None:
    form = Format("{{ 'a b' }}\n\"quoted\" $HOME", ("\nUser:", "'"), 4096)
    word = form.to_arg()
    assert word.isascii() and not any(c in word for c in " \n'\"$")
    assert Format.from_arg(word) == form
    assert Format.from_arg(None) == Format()


def _store(root: Path, layers: dict[str, bytes | None]) -> None:
    """An ollama store with manifest `tiny:latest`; a layer of None has no blob."""
    import hashlib

    entries = []
    for kind, data in layers.items():
        digest = hashlib.sha256(data or kind.encode()).hexdigest()
        if data is not None:
            blob = root / "blobs" / f"sha256-{digest}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
        entries.append(
            {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}"}
        )
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": entries}))


def test_an_ollama_manifests_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exokv.model.ollama import run_defaults

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    go = b"{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}..."
    params = {"stop": ["<|im_end|>", "\nUser:"], "temperature": 0.7, "num_ctx": 2048}
    _store(
        tmp_path,
        {
            "model": b"GGUF",
            "template": go,
            "system": b"You are terse.",
            "params": json.dumps(params).encode(),
        },
    )
    form = run_defaults("tiny")
    assert form.template == "chatml" and form.system == "You are terse."
    assert form.stops == ("<|im_end|>", "\nUser:") and form.temperature == 0.7
    assert form.context == 2048 and form.notes == []

    _store(tmp_path, {"model": b"GGUF", "template": b"{{ .Prompt }}", "params": b'{"stop": "END"}'})
    form = run_defaults("tiny")
    assert form.template is None and form.stops == ("END",) and form.system is None
    assert len(form.notes) == 1 and "GGUF's own" in form.notes[0]

    _store(tmp_path, {"model": b"GGUF", "template": None, "params": b"not json"})  # no blob
    form = run_defaults("tiny")
    assert (
        form.template is None
        and form.stops == ()
        and form.notes == ["the params of ollama:tiny are not JSON: ignored"]
    )


def test_generation_stops_on_every_end_of_turn_token_of_the_template(
    tokenizers: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exokv.model.resolve import load_model
    from exokv.rank.engine import Engine, EngineOptions

    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    model, tokenizer = load_model("builtin:tiny")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext not in tokenizer.eos_token_ids  # not an end for the model's own template
    options = EngineOptions(chat_template="qwen", stops=("!",), context=16)  # num_ctx 16
    engine = Engine(model, tokenizer, options=options)
    assert engine.context == 16
    assert {endoftext, tokenizer.convert_tokens_to_ids("<|im_end|>")} <= engine._eos
    assert endoftext in tokenizer.eos_token_ids  # decode() stops on it too
    assert engine.stops == ("!",) and engine.template.name == "qwen"
