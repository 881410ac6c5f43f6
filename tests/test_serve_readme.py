"""The README's `exokv serve` examples — curl, the OpenAI Python client, llm, the
Anthropic and ollama Python clients configured from the environment — run as written
against a server on builtin:tiny (only the port is changed); Codex's configuration
names the Responses API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chat_helpers import home_with_models
from tests.serve_helpers import MODEL, serving

README = Path(__file__).resolve().parent.parent / "README.md"


def serve_blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    start = text.index("## Serving an OpenAI-compatible API")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def block(lang: str, holding: str) -> str:
    found = [code for kind, code in serve_blocks() if kind == lang and holding in code]
    assert len(found) == 1, (lang, holding)
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path):
    home = home_with_models(tmp_path_factory.mktemp("readme") / "h", models_dir, link=True)
    with serving(home) as s:
        yield s


def on_port(code: str, server) -> str:
    return code.replace("http://127.0.0.1:8000", server.url)


def reference(server, text: str, **kw) -> str:
    messages = [{"role": "user", "content": text}]
    done = server.client().chat.completions.create(model=MODEL, messages=messages, **kw)
    return done.choices[0].message.content


@pytest.mark.slow
def test_the_curl_example(server) -> None:
    proc = subprocess.run(
        ["bash", "-c", on_port(block("sh", "curl"), server)], capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["choices"][0]["message"]["content"] == reference(server, "hello", max_tokens=12)


@pytest.mark.slow
def test_the_python_example(server) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", on_port(block("python", "OpenAI"), server)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    cached, prompt = re.search(r"(\d+) of (\d+) prompt tokens from the cache", proc.stdout).groups()
    assert 0 < int(cached) < int(prompt)


@pytest.mark.slow
def test_the_llm_example(server, tmp_path: Path) -> None:
    llm_dir = tmp_path / "llm"
    llm_dir.mkdir()
    (llm_dir / "extra-openai-models.yaml").write_text(on_port(block("yaml", "model_id"), server))
    env = {
        **os.environ,
        "LLM_USER_PATH": str(llm_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    command = block("sh", "llm -m")
    proc = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    # llm streams and sends no max_tokens or temperature: the server's defaults (256, 0).
    assert proc.stdout.rstrip("\n") == reference(server, "hello")


def _python_example(server, setup_marker: str, code_marker: str) -> subprocess.CompletedProcess:
    """The README's shell set-up block (pointed at `server`) then its Python block, run
    as a user pastes them; a failure shows their stderr."""
    setup = on_port(block("sh", setup_marker), server)
    code = block("python", code_marker)
    proc = subprocess.run(
        ["bash", "-c", f'{setup}\n"{sys.executable}" -c "$CODE"'],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CODE": code},
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_the_anthropic_example(server) -> None:
    proc = _python_example(server, "export ANTHROPIC_BASE_URL", "anthropic.Anthropic()")
    cached, new = re.search(r"(\d+) prompt tokens from the cache, (\d+) new", proc.stdout).groups()
    assert int(cached) > 0 and int(new) > 0


def test_the_agents_are_pointed_at_the_server() -> None:
    agent = block("sh", "claude")
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:8000 " in agent
    assert "ANTHROPIC_AUTH_TOKEN=" in agent  # Claude Code's bearer key: the server takes it


@pytest.mark.slow
def test_the_ollama_example(server) -> None:
    proc = _python_example(server, "export OLLAMA_HOST", "import ollama")
    listed, rest = proc.stdout.split("\n", 1)
    assert listed == f"['{MODEL}']"
    said, counts = rest.removesuffix("\n").rsplit("\n", 1)
    assert said == reference(server, "hello", max_tokens=12)
    assert re.fullmatch(r"12 tokens, \d+ in the prompt", counts)


def test_codex_is_pointed_at_the_responses_api() -> None:
    config = block("toml", "wire_api")
    assert 'model_provider = "exokv"' in config and "[model_providers.exokv]" in config
    assert 'wire_api = "responses"' in config
    assert 'base_url = "http://127.0.0.1:8000/v1"' in config  # Codex adds /responses
