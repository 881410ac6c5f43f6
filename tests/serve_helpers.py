"""`exokv serve` as a user runs it: a subprocess on a free port, its log collected."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chat_helpers import home_with_models

MODEL = "builtin:tiny"


def server_and_chat_homes(root: Path, models_dir: Path) -> tuple[Path, Path]:
    """Two state dirs under `root` that share the built models: a server's and a chat's."""
    return (
        home_with_models(root / "server", models_dir, link=True),
        home_with_models(root / "chat", models_dir, link=True),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    home: Path
    log: list[str] = field(default_factory=list)  # stderr lines so far

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def client(self, key: str = "none", **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=120, **kw)

    def access(self, status: int | None = None) -> list[str]:
        lines = [x for x in self.log if " /v1/" in x]
        return [x for x in lines if f" {status} " in x] if status is not None else lines

    def wait_log(self, predicate: Any, timeout: float = 30, count: int = 1) -> list[str]:
        """The log lines `predicate` takes, once there are `count` of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [x for x in self.log if predicate(x)]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such log line; log: {self.log[-20:]}")


def raw(
    url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, JSON body) of a request sent as bytes, errors included."""
    request = urllib.request.Request(url, data=body, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def _drain(proc: subprocess.Popen[bytes], lines: list[str]) -> None:
    assert proc.stderr is not None
    for raw_line in iter(proc.stderr.readline, b""):
        lines.append(raw_line.decode(errors="replace").rstrip())


@contextmanager
def serving(
    home: Path, *args: str, env: dict[str, str] | None = None, ready_s: float = 120
) -> Iterator[Server]:
    """`exokv serve --model builtin:tiny ARGS` on a free port until the block ends (SIGTERM)."""
    port = free_port()
    full_env = {**os.environ, "EXOKV_HOME": str(home), **(env or {})}
    full_env.pop("EXOKV_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "exokv", "serve", "--model", MODEL, "--port", str(port), *args],
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server = Server(f"http://127.0.0.1:{port}", proc, home)
    reader = threading.Thread(target=_drain, args=(proc, server.log), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + ready_s
        while not any("serving " in x for x in server.log):
            if proc.poll() is not None or time.monotonic() > deadline:
                reader.join(timeout=5)
                raise AssertionError(f"the server did not start: {server.log}")
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)


def conversation_replies(server: Server, turns: list[str], system: str, max_tokens: int) -> list:
    """Each turn's completion, one call per turn with the whole history (as clients do)."""
    client = server.client()
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        done = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
        )
        out.append(done)
        messages.append({"role": "assistant", "content": done.choices[0].message.content})
    return out


class InProcess:
    """Servers run in this process's threads over a given client (a stand-in), each on
    its own port; `close()` stops them all."""

    def __init__(self) -> None:
        self._running: list[tuple[Any, threading.Thread, Any]] = []

    def start(
        self, client: Any, log: Any = None, tools: Any = None, with_tools: bool = False
    ) -> int:
        import uvicorn

        from exokv.serve.app import Service, build_app
        from exokv.serve.work import TurnQueue

        queue = TurnQueue(client, 4)
        service = Service(model="m", names={"m"}, queue=queue, ranks=1, log=log or (lambda _: None))
        if with_tools:
            service.tools = lambda: tools
        port = free_port()
        config = uvicorn.Config(build_app(service), port=port, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        self._running.append((server, thread, queue))
        return port

    def close(self) -> None:
        for server, thread, queue in self._running:
            server.should_exit = True
            thread.join(timeout=10)
            queue.close(timeout=1)
