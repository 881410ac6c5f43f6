"""The small channel between the front end and rank 0.

Wire format: a 4-byte big-endian length, then that many bytes of one UTF-8 JSON
object: a message of exokv.wire.messages. Nothing but JSON ever crosses it (no
pickle off the network), every message has a size limit, and a connection must
present the random token in its first message before anything it says is
believed. A connection that does not is answered with one `refused` message and
closed; the chat never notices.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from exokv.errors import ExokvError
from exokv.wire import messages
from exokv.wire.messages import Hello, Message, Refused, Welcome

MAX_MESSAGE = 16 * 1024 * 1024  # a whole conversation plus a turn's cache report fits
HELLO_LIMIT = 4096  # the first message of a connection: the token and a few fields
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to present the token
_HEADER = struct.Struct(">I")
_NOT_HELLO = "the first message was not a hello with a token"


class ChannelError(ExokvError):
    """The channel broke or a peer broke the protocol."""


class MessageTooLarge(ChannelError):
    """A message over the size limit, refused before any of it was sent or read."""


class MalformedMessage(ChannelError):
    """JSON that is not a message (exokv.wire.messages.decode refused it)."""


def frame(message: dict[str, Any], limit: int = MAX_MESSAGE) -> bytes:
    """One framed JSON object; refuses (raises) rather than sending more than `limit` bytes."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > limit:
        raise MessageTooLarge(f"message of {len(body)} bytes is over the {limit}-byte limit")
    return _HEADER.pack(len(body)) + body


class Connection:
    """One framed connection of messages; `send` may be called from several threads."""

    def __init__(self, sock: socket.socket, limit: int = MAX_MESSAGE) -> None:
        self.sock = sock
        self.limit = limit
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, message: Message) -> None:
        data = frame(messages.encode(message), self.limit)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as err:
                raise ChannelError(f"channel closed while sending ({err})") from None

    def recv(self, limit: int | None = None) -> Message | None:
        """The next message, or None at a clean end of stream.

        A length over the limit is refused before its body is read, so a peer
        cannot make this side buffer more than the limit.
        """
        limit = self.limit if limit is None else limit
        header = self._read(_HEADER.size, eof_ok=True)
        if header is None:
            return None
        (size,) = _HEADER.unpack(header)
        if size > limit:
            raise MessageTooLarge(f"message of {size} bytes is over the {limit}-byte limit")
        body = self._read(size, eof_ok=False)
        assert body is not None
        try:
            data = json.loads(body.decode())
        except (UnicodeDecodeError, ValueError):
            raise ChannelError("a message that is not JSON") from None
        try:
            return messages.decode(data)
        except messages.MessageError as err:
            raise MalformedMessage(str(err)) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self, n: int, eof_ok: bool) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < n:
            try:
                data = self.sock.recv(min(n - len(chunks), 1 << 20))
            except TimeoutError:
                raise ChannelError("timed out waiting for the peer") from None
            except OSError as err:
                if self._closed:
                    return None if eof_ok and not chunks else b""
                raise ChannelError(f"channel closed while receiving ({err})") from None
            if not data:
                if eof_ok and not chunks:
                    return None
                raise ChannelError("channel closed in the middle of a message")
            chunks += data
        return bytes(chunks)


class ChannelServer:
    """Listens for rank 0; accepts exactly one connection that presents the token.

    Every other connection (no token, wrong token, oversized or garbled hello, or
    a second one after rank 0 is in) is refused on its own thread, so it cannot
    disturb the chat that is running over the accepted connection.
    """

    def __init__(self, host: str = "127.0.0.1", limit: int = MAX_MESSAGE) -> None:
        self.token = secrets.token_hex(32)
        self.limit = limit
        self.refused: list[str] = []  # why each refused connection was refused
        self.peer: Connection | None = None
        self.hello: Hello | None = None
        self._connected = threading.Event()
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="exokv-channel", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> Connection | None:
        """The authenticated connection, or None if none arrived within `timeout`."""
        self._connected.wait(timeout)
        return self.peer

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        if self.peer is not None:
            self.peer.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        conn = Connection(sock, self.limit)
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            try:
                hello = conn.recv(limit=HELLO_LIMIT)
            except MalformedMessage:
                raise ChannelError(_NOT_HELLO) from None
            if hello is None:
                raise ChannelError("closed before presenting a token")
            if not isinstance(hello, Hello):
                raise ChannelError(_NOT_HELLO)
            if not hmac.compare_digest(hello.token.encode(), self.token.encode()):
                raise ChannelError("wrong token")
            with self._lock:
                if self.peer is not None:
                    raise ChannelError("rank 0 is already connected")
                self.peer = conn
            sock.settimeout(None)
            self.hello = hello
            conn.send(Welcome())
            self._connected.set()
        except Exception as err:  # noqa: BLE001 - whatever a stranger sends ends in a refusal
            # (json.loads itself raises RecursionError on a deeply nested hello.)
            if not isinstance(err, ChannelError):
                err = ChannelError(f"a malformed hello ({type(err).__name__})")
            self.refused.append(str(err))
            try:
                conn.send(Refused(str(err)))
            except ChannelError:
                pass
            conn.close()


def connect(
    addresses: Sequence[str], token: str, info: dict[str, Any] | None = None, timeout: float = 10.0
) -> Connection:
    """Rank 0's side: reach the front end at the first address that answers, and log in."""
    errors = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as err:
            errors.append(f"{address}: {err}")
            continue
        conn = Connection(sock)
        conn.send(Hello(token, **(info or {})))
        reply = conn.recv()
        if not isinstance(reply, Welcome):
            conn.close()
            reason = reply.reason if isinstance(reply, Refused) else "connection closed"
            raise ChannelError(f"the front end refused rank 0: {reason}")
        sock.settimeout(None)
        return conn
    raise ChannelError("could not reach the front end: " + "; ".join(errors))
