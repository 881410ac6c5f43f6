"""Chats with a chosen or fallback template: a base GGUF (no template, no chat tokens)
on one and two ranks, --chat-template kept by a resumed session, and an ollama model
run with its manifest's template, system prompt and stop sequence."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import run_exokv
from gguf_helpers import write_gguf

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

TURNS = ["hello there", "what is a cache", "and a tree?"]
FILE_TEMPLATE = (
    "### a conversation\n{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tpl")
    home, models, ollama = root / "home", root / "models", root / "ollama"
    subprocess.run(
        [sys.executable, "-c", "from exokv.model import builtin; builtin.ensure_builtin('tiny')"],
        env={**os.environ, "EXOKV_HOME": str(home)},
        check=True,
        timeout=180,
    )
    base = write_gguf(home / "models" / "tiny", root / "base.gguf", base=True)
    (root / "t.jinja").write_text(FILE_TEMPLATE)
    values = {"EXOKV_HOME": str(home), "EXOKV_MODELS": str(models), "OLLAMA_MODELS": str(ollama)}
    yield {"root": root, "home": home, "base": base, "ollama": ollama, "env": values}


def _chat(
    env: dict[str, Any], model: str, *extra: str, turns: list[str] = TURNS, home: Path | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Script mode with --json: the turns' objects and stderr's lines."""
    proc = run_exokv(
        ["chat", "--model", model, "--json", "--max-tokens", "10", "--disk-budget", "0", *extra],
        home or env["home"],
        "\n".join(turns) + "\n",
        env={**env["env"], **({"EXOKV_HOME": str(home)} if home else {})},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    lines = [x for x in proc.stderr.decode().splitlines() if x.strip()]
    return [d for d in docs if "turn" in d], lines


def _template_lines(lines: list[str]) -> list[str]:
    return [x for x in lines if "chat template" in x]


def test_a_base_gguf_chats_on_one_and_two_ranks_with_the_fallback_named_once(
    env: dict[str, Any],
) -> None:
    base = str(env["base"])
    one, said = _chat(env, base, "--system", "Be brief.")
    assert len(_template_lines(said)) == 1, said
    assert "plain" in _template_lines(said)[0] and "base model" in _template_lines(said)[0]
    cold, _ = _chat(env, base, "--system", "Be brief.", "--no-cache")
    two, said2 = _chat(env, base, "--system", "Be brief.", "-n", "2", "--parallel", "pipeline")
    assert _template_lines(said2) == _template_lines(said), said2
    replies = [d["reply"] for d in one]
    assert replies == [d["reply"] for d in cold] == [d["reply"] for d in two]
    assert len(set(replies)) == len(replies) and all(replies)
    for run in (one, two):
        assert run[0]["cached_tokens"] == 0
        assert all(d["cached_tokens"] > 0 for d in run[1:]), run
        assert [d["prompt_tokens"] for d in run] == [d["prompt_tokens"] for d in cold]
    assert all(d["cached_tokens"] == 0 for d in cold)


def test_chat_template_changes_the_prompt_and_a_resumed_session_keeps_it(
    env: dict[str, Any], tmp_path: Path
) -> None:
    base, file = str(env["base"]), str(env["root"] / "t.jinja")
    plain, _ = _chat(env, base, turns=TURNS[:2])
    chatml, said = _chat(env, base, "--chat-template", "chatml", turns=TURNS[:2])
    filed, said2 = _chat(env, base, "--chat-template", file, turns=TURNS[:2])
    assert not _template_lines(said) and not _template_lines(said2)  # chosen: nothing to say
    counts = {tuple(d["prompt_tokens"] for d in run) for run in (plain, chatml, filed)}
    assert len(counts) == 3, counts
    # One turn, then the session resumed without the flag: the template is the file's.
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(env["home"] / "models")
    first, _ = _chat(
        env, base, "--chat-template", file, "--session", "s", turns=TURNS[:1], home=home
    )
    later, said3 = _chat(env, base, "--session", "s", turns=TURNS[1:2], home=home)
    assert first[0]["prompt_tokens"] == filed[0]["prompt_tokens"]
    assert later[0]["prompt_tokens"] == filed[1]["prompt_tokens"], (later, filed)
    assert later[0]["reply"] == filed[1]["reply"]
    assert not _template_lines(said3), said3
    shown = run_exokv(
        ["sessions", "show", "s", "--json"], home, env={**env["env"], "EXOKV_HOME": str(home)}
    )
    assert shown.returncode == 0, shown.stderr.decode()
    # The file's text is kept, not its path: the file may move.
    assert json.loads(shown.stdout)["chat_template"] == FILE_TEMPLATE


def test_a_bad_chat_template_is_one_line_and_exit_2(env: dict[str, Any]) -> None:
    refusing = env["root"] / "refuses.jinja"
    refusing.write_text("{{ raise_exception('no conversation here') }}")
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--chat-template", str(refusing), "hi"],
        env["home"],
        env=env["env"],
    )
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert "cannot render a conversation" in lines[0] and "no conversation here" in lines[0]
    for value, words in (
        ("nope", "not a built-in template"),
        ("/no/such.jinja", "nor a Jinja file"),
    ):
        proc = run_exokv(
            ["chat", "--model", "builtin:tiny", "--chat-template", value, "hi"],
            env["home"],
            env=env["env"],
        )
        lines = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], lines


def _pull(env: dict[str, Any], name: str, layers: dict[str, bytes]) -> None:
    """Lay the base GGUF out in the ollama store as `ollama pull` does, with `layers`."""
    entries = []
    for kind, data in {"model": env["base"].read_bytes(), **layers}.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = env["ollama"] / "blobs" / f"sha256-{digest}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        entries.append(
            {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}"}
        )
    manifest = env["ollama"] / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": entries}))


GO_CHATML = (
    b"{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    b"{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    b"<|im_start|>assistant\n"
)


def test_an_ollama_model_runs_with_its_template_system_prompt_and_stop(
    env: dict[str, Any],
) -> None:
    base, system = str(env["base"]), "You answer in one word."
    # As exokv runs the file itself with the template and system ollama would use.
    direct, _ = _chat(env, base, "--chat-template", "chatml", "--system", system, turns=TURNS[:1])
    reply = direct[0]["reply"]
    word = next(m for m in re.finditer(r"[A-Za-z]{3,}", reply) if m.start() > 0).group()
    params = json.dumps({"stop": [word], "temperature": 0, "num_ctx": 4096}).encode()
    _pull(env, "tiny", {"template": GO_CHATML, "system": system.encode(), "params": params})
    run, said = _chat(env, "ollama:tiny", turns=TURNS[:1])
    assert not _template_lines(said), said  # the manifest's template: no fallback
    assert run[0]["prompt_tokens"] == direct[0]["prompt_tokens"]
    assert run[0]["reply"] == reply[: reply.index(word)], (run[0]["reply"], reply, word)
    assert run[0]["finish_reason"] == "stop"
    # Given a system prompt, the user's wins over the manifest's.
    own, _ = _chat(env, "ollama:tiny", "--system", "Hi.", turns=TURNS[:1])
    assert own[0]["prompt_tokens"] != run[0]["prompt_tokens"]

    # A template exokv does not recognise: the GGUF's own (none here: the plain format).
    _pull(env, "odd", {"template": b"{{ .Prompt }}"})
    _, said = _chat(env, "ollama:odd", turns=TURNS[:1])
    assert any("not one exokv recognises" in x for x in said), said
    assert len(_template_lines(said)) == 1 and "plain" in _template_lines(said)[0], said


def test_serve_renders_and_stops_as_the_chat_does(env: dict[str, Any]) -> None:
    from serve_helpers import serving

    base, system = str(env["base"]), "You answer in one word."
    direct, _ = _chat(env, base, "--chat-template", "chatml", "--system", system, turns=TURNS[:1])
    reply = direct[0]["reply"]
    word = next(m for m in re.finditer(r"[A-Za-z]{3,}", reply) if m.start() > 0).group()
    params = json.dumps({"stop": [word]}).encode()
    _pull(env, "served", {"template": GO_CHATML, "system": system.encode(), "params": params})
    with serving(
        env["home"], "--model", "ollama:served", "--disk-budget", "0", env=env["env"]
    ) as server:
        messages = [{"role": "user", "content": TURNS[0]}]  # the manifest's system prompt
        done = server.client().chat.completions.create(
            model="ollama:served", messages=messages, max_tokens=10, temperature=0
        )
    assert done.usage.prompt_tokens == direct[0]["prompt_tokens"]
    assert done.choices[0].message.content == reply[: reply.index(word)]
    assert done.choices[0].finish_reason == "stop"
