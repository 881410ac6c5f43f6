"""A stand-in for the Hugging Face hub's HTTP API, serving a zoo model as several shards.

The handful of endpoints huggingface_hub calls for a model, as the hub answers them:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the model
  info (``sha``, ``siblings``; with ``?blobs=true`` each sibling's ``size``);
- ``GET /api/models/{repo}/tree/{rev}``: the file list snapshot_download reads;
- ``HEAD`` and ``GET /{repo}/resolve/{rev}/{path}``: a file, with ``X-Repo-Commit``,
  ``ETag`` (and ``X-Linked-Etag``/``X-Linked-Size`` for weights, as for LFS files),
  ``Content-Length`` and ``Range`` requests (206 with ``Content-Range``), which
  resumed downloads and ``get_safetensors_metadata``'s header reads use;
- 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` / ``EntryNotFound``.

The model is ``builtin:llama-tiny`` (4 layers), whose weights exokv writes as one
shard for the tensors outside the layers (embedding, norm, head) and one shard per
layer, with a ``model.safetensors.index.json``: which shards a host fetched shows
which layers it holds. Every request is counted per file (``gets``, and the Range
starts in ``ranges``; per repo in ``repo_gets``), so a test can assert that a chat
downloaded nothing; ``cut`` drops the connection part way through a file's next
download. ``DRAFT_REPO`` serves the same files under a second name: a draft model
with the model's own tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

REPO = "acme/llama-tiny"
DRAFT_REPO = "acme/llama-draft"
COMMIT = "c0ffee" + "0" * 28 + "123456"  # 40 hex digits, like a git commit
REVISIONS = {"main": COMMIT, "v1": COMMIT, COMMIT: COMMIT}
LAYERS = 4
NON_LAYER_SHARD = "model-00001-of-00005.safetensors"


def layer_shard(layer: int) -> str:
    """The shard that holds decoder layer ``layer``."""
    return f"model-{layer + 2:05d}-of-00005.safetensors"


def build_repo(out: Path) -> Path:
    """llama-tiny's files (exokv writes its weights as one shard for the tensors outside
    the layers and one per layer, with an index) under ``out``, its marker left out."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    scratch = out.parent / f"{out.name}-home"
    code = "from exokv.model import zoo; print(zoo.ensure_zoo('llama-tiny'))"
    made = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "EXOKV_HOME": str(scratch)},
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    src = Path(made.stdout.strip().splitlines()[-1])
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.name.startswith("exokv_"):
            shutil.copy(f, out / f.name)
    shutil.rmtree(scratch, ignore_errors=True)
    return out


@dataclass
class StandinHub:
    """The server and what it was asked; ``url`` is the HF_ENDPOINT to give huggingface_hub."""

    files: dict[str, bytes]
    repos: tuple[str, ...] = (REPO, DRAFT_REPO)
    gets: Counter[str] = field(default_factory=Counter)  # file -> GETs of its bytes
    repo_gets: Counter[str] = field(default_factory=Counter)  # repo -> GETs of its files
    ranges: dict[str, list[int]] = field(default_factory=dict)  # file -> Range GETs' starts
    cut: dict[str, int] = field(default_factory=dict)  # file -> its next GET stops there
    heads: Counter[str] = field(default_factory=Counter)
    infos: int = 0  # model info calls
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self, port: int = 0) -> StandinHub:
        hub = self

        class Handler(_Handler):
            standin = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def downloaded(self) -> set[str]:
        return {name for name, n in self.gets.items() if n}


def standin(root: Path) -> StandinHub:
    """A stand-in serving llama-tiny as ``REPO`` (built once under ``root``), not yet started."""
    repo = build_repo(root / "repo")
    return StandinHub({p.name: p.read_bytes() for p in sorted(repo.iterdir()) if p.is_file()})


class _Handler(BaseHTTPRequestHandler):
    standin: StandinHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(head=True)

    def _answer(self, head: bool) -> None:
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        hub = self.standin
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, rest = "/".join(parts[2:4]), parts[4:]
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if not rest or rest[0] == "revision":
                rev = "/".join(rest[1:]) or "main"
                if rev not in REVISIONS:
                    return self._error(404, "RevisionNotFound")
                hub.infos += 1
                blobs = parse_qs(url.query).get("blobs", [""])[0].lower() == "true"
                siblings = [
                    {"rfilename": n, **({"size": len(b)} if blobs else {})}
                    for n, b in sorted(hub.files.items())
                ]
                return self._json({"id": repo, "sha": REVISIONS[rev], "siblings": siblings})
            if rest[0] == "tree":
                if "/".join(rest[1:]) not in REVISIONS:
                    return self._error(404, "RevisionNotFound")
                tree = [
                    {"type": "file", "path": n, "size": len(b), "oid": _sha1(b)}
                    for n, b in sorted(hub.files.items())
                ]
                return self._json(tree)
            return self._error(404, "EntryNotFound")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if rev not in REVISIONS:
                return self._error(404, "RevisionNotFound")
            if name not in hub.files:
                return self._error(404, "EntryNotFound")
            if not head:
                hub.repo_gets[repo] += 1
            return self._file(name, REVISIONS[rev], head)
        return self._error(404, "RepoNotFound")

    def _file(self, name: str, commit: str, head: bool) -> None:
        body = self.standin.files[name]
        etag = f'"{hashlib.sha256(body).hexdigest()}"'
        start, end = 0, len(body)
        wanted = self.headers.get("Range", "")
        status = 200
        if wanted.startswith("bytes=") and not head:
            first, _, last = wanted[6:].partition("-")
            start = int(first or 0)
            end = min(int(last) + 1, len(body)) if last else len(body)
            status = 206
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", etag)
        if name.endswith(".safetensors"):
            self.send_header("X-Linked-Etag", etag)
            self.send_header("X-Linked-Size", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.send_header("Content-Length", str(end - start if not head else len(body)))
        self.end_headers()
        if head:
            self.standin.heads[name] += 1
            return
        self.standin.gets[name] += 1  # whole or a range: bytes of the file went out
        if status == 206:
            self.standin.ranges.setdefault(name, []).append(start)
        stop = self.standin.cut.pop(name, None)
        if stop is not None:  # the connection drops mid-file, as a network does
            self.wfile.write(body[start:stop])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body[start:end])

    def _json(self, data: object) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()  # noqa: S324 - git's blob id, not security
