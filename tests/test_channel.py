"""The front end <-> rank 0 channel: JSON only, a size limit, a token first."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import psutil
import pytest

from exokv.client.cluster import ClusterClient
from exokv.core.records import TurnRequest
from exokv.frontend.start import ChatOptions, validate
from exokv.wire import channel
from exokv.wire.messages import Heartbeat, Hello, Message, Refused, Status


def pair(limit: int = channel.MAX_MESSAGE) -> tuple[channel.Connection, channel.Connection]:
    a, b = socket.socketpair()
    return channel.Connection(a, limit), channel.Connection(b, limit)


def raw_connect(server: channel.ChannelServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def read_reply(sock: socket.socket) -> Message | None:
    """The server's answer to a stray connection, or None if it just closed."""
    try:
        return channel.Connection(sock).recv()
    except channel.ChannelError:
        return None


# -- framing ---------------------------------------------------------------------------


def test_round_trip_and_clean_end_of_stream() -> None:
    a, b = pair()
    a.send(Status("héllo"))
    assert b.recv() == Status("héllo")
    a.close()
    assert b.recv() is None


def test_oversize_message_refused_on_both_sides() -> None:
    a, b = pair(limit=100)
    with pytest.raises(channel.ChannelError, match="limit"):
        a.send(Status("x" * 200))  # refused before anything is sent
    # A peer that claims a huge body is refused from the header alone, unread.
    a.sock.sendall(struct.pack(">I", 1 << 30))
    with pytest.raises(channel.ChannelError, match="limit"):
        b.recv()


def test_only_json_objects_with_a_type() -> None:
    for body in (b"\x80\x81 not utf-8", b"[1, 2]", b'{"no": "type"}', b"{bad json"):
        a, b = pair()
        a.sock.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(channel.ChannelError):
            b.recv()


# -- the server: a token first, one rank 0 ---------------------------------------------


def test_server_refuses_strays_and_accepts_the_token() -> None:
    server = channel.ChannelServer()
    try:
        assert server.host == "127.0.0.1"
        no_token = raw_connect(server)
        no_token.sendall(channel.frame({"type": "hello"}))
        assert read_reply(no_token) == Refused("the first message was not a hello with a token")
        wrong = raw_connect(server)
        channel.Connection(wrong).send(Hello("0" * 64))
        assert read_reply(wrong).reason == "wrong token"
        huge = raw_connect(server)
        huge.sendall(struct.pack(">I", 50_000_000))
        assert read_reply(huge).reason.endswith("over the 4096-byte limit")

        rank0 = channel.connect([f"{server.host}:{server.port}"], server.token)
        peer = server.wait(5)
        assert peer is not None
        rank0.send(Heartbeat())
        assert peer.recv() == Heartbeat()
        with pytest.raises(channel.ChannelError, match="already connected"):
            channel.connect([f"{server.host}:{server.port}"], server.token)
        assert len(server.refused) == 4
    finally:
        server.close()


# -- strays during a real two-rank chat -------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_strays_do_not_disturb_a_running_chat(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("EXOKV_HOME", str(home))
    monkeypatch.delenv("EXOKV_DEBUG", raising=False)
    opts = ChatOptions(model="builtin:tiny", ranks=2, max_tokens=8, starting_port=25160)
    client = ClusterClient(validate(opts))
    kids = psutil.Process().children(recursive=True)
    try:
        messages = [{"role": "user", "content": "Hello, who are you?"}]
        first = client.turn(TurnRequest("s", messages, max_tokens=8))
        server = client._server
        assert server is not None and server.host == "127.0.0.1"
        # The token reached rank 0 through the launcher's stdin: no command line or
        # environment (both visible to other users through ps) carries it.
        for p in kids:
            assert server.token not in " ".join(p.cmdline())
            assert server.token not in " ".join(p.environ().values())

        # A stranger without the token, one with a 50 MB message, and one that says nothing.
        no_token = raw_connect(server)
        no_token.sendall(channel.frame({"type": "turn", "request": {"messages": []}}))
        no_token_reason = "the first message was not a hello with a token"
        huge = raw_connect(server)
        huge.sendall(struct.pack(">I", 50_000_000) + b"x" * 1000)
        huge_reason = "message of 50000000 bytes is over the 4096-byte limit"
        silent = raw_connect(server)
        assert isinstance(read_reply(no_token), Refused)
        # The server refuses from the header, unread: with bytes still unread it may
        # reset the connection before its "refused" gets here. Either way it is out.
        assert read_reply(huge) in (None, Refused(huge_reason))

        # The chat goes on, served from the cache as before.
        messages += [
            {"role": "assistant", "content": first.reply},
            {"role": "user", "content": "Tell me about the sea."},
        ]
        second = client.turn(TurnRequest("s", messages, max_tokens=8))
        assert second.cached_tokens > 0 and second.ranks == 2
        silent.close()

        # Ctrl-C: the reply stops on every rank at the same token; the next turn works
        # (ranks compare their cache trees in every turn's collective). The stop races
        # the decode, so the reply may run on a while on a loaded machine: 2000 tokens
        # leave room, and a stop that lands ends it long before.
        pieces: list[str] = []

        def on_text(text: str) -> None:
            pieces.append(text)
            if len(pieces) == 1:
                client.stop()

        messages += [
            {"role": "assistant", "content": second.reply},
            {"role": "user", "content": "Why is the sky blue?"},
        ]
        stopped = client.turn(TurnRequest("s", messages, max_tokens=2000), on_text=on_text)
        assert stopped.finish_reason == "interrupted"
        assert stopped.generated_tokens < 2000
        messages += [
            {"role": "assistant", "content": stopped.reply},
            {"role": "user", "content": "Thanks."},
        ]
        assert client.turn(TurnRequest("s", messages, max_tokens=8)).cached_tokens > 0
        assert {huge_reason, no_token_reason} <= set(client.refused)
    finally:
        client.close()
    assert alive_after(kids, 10) == []


def alive_after(procs: list[psutil.Process], seconds: float) -> list[int]:
    """The processes still running (not zombies) after waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
