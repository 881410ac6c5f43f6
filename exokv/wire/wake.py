"""A doorbell from rank 0 to the other ranks, so they wait for the next turn asleep.

Between turns rank 0 waits for the user on a queue (no CPU), but a collective
that is waiting for its peers spins: mlx's ring backend polls its sockets, and
so does a point-to-point `recv`. A rank that entered the turn's broadcast would
keep a core at 100% for as long as the user takes to type. So every rank other
than rank 0 first blocks on a plain TCP socket for one byte that rank 0 sends
just before it enters the broadcast; then the broadcast meets no wait worth
spinning for.

The same bell comes before each stop check of a turn (exokv.rank.main.CountingGroup):
a stop check follows rank 0's share of the step (on a pipeline, rank 0 runs the last
layers after the others ran theirs), so the other ranks would spin in it for as long
as rank 0 computes, taking a core from it where ranks share a machine (issue 45:
two ranks on one two-core machine). Every rank calls the stop checks at the same
points, so each byte rank 0 sends meets one wait on every other rank.

On two pipeline ranks it also carries a byte the other way for each piece of a
prefill (`PieceBell`): rank 1 runs its layers of a piece and sends the hidden state
on, rank 0 receives it and runs the last layers; rank 0 waits for that byte asleep
instead of spinning in mlx's receive while rank 1 computes.

The doorbell is set up once, after the model is loaded: rank 0 listens on the
address the others reach it at, broadcasts that address and a random key (over
the ring, like everything else the ranks exchange), and accepts exactly one
connection per other rank that presents the key. A connection without the key
is closed. Only single "go" bytes ever cross it.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from typing import Any

from exokv.errors import ExokvError

CONNECT_TIMEOUT = 60.0  # every other rank reaches rank 0's doorbell within this
_KEY_BYTES = 16
_GO = b"g"
_PIECE = b"p"  # rank 1 to rank 0: a prefill piece's hidden state is on its way


class Doorbell:
    """Rank 0 rings it before each broadcast; every other rank waits on it first."""

    def __init__(self, rank: int, peers: list[socket.socket]) -> None:
        self.rank = rank
        self.peers = peers  # rank 0: one socket per other rank; others: the one to rank 0

    @classmethod
    def connect(cls, group: Any, host: str) -> Doorbell:
        """Set up on every rank (one broadcast); `host`: where rank 0 listens."""
        if group.size == 1:
            return cls(group.rank, [])
        if group.rank == 0:
            server = socket.create_server((host, 0))
            key = secrets.token_hex(_KEY_BYTES)
            group.broadcast({"host": host, "port": server.getsockname()[1], "key": key})
            try:
                return cls(0, _accept(server, key, group.size - 1))
            finally:
                server.close()
        where = group.broadcast(None)
        sock = socket.create_connection((where["host"], where["port"]), timeout=CONNECT_TIMEOUT)
        sock.sendall(where["key"].encode())
        sock.settimeout(None)
        return cls(group.rank, [sock])

    def cross(self) -> None:
        """Rank 0: wake the others. Any other rank: sleep until rank 0 does."""
        if not self.peers:
            return
        if self.rank == 0:
            for sock in self.peers:
                try:
                    sock.sendall(_GO)
                except OSError:
                    pass  # that rank is gone: the broadcast that follows says so
            return
        try:
            data = self.peers[0].recv(1)
        except OSError as err:
            raise ExokvError(f"lost rank 0 while waiting for it ({err})") from None
        if data != _GO:
            raise ExokvError("lost rank 0 while waiting for it")

    def piece_bell(self) -> PieceBell | None:
        """The bell for each piece of a prefill, on two ranks (None with more: the ranks
        between would need one from their neighbour, which the doorbell does not join)."""
        return PieceBell(self.rank, self.peers[0]) if len(self.peers) == 1 else None

    def close(self) -> None:
        for sock in self.peers:
            try:
                sock.close()
            except OSError:
                pass


def _accept(server: socket.socket, key: str, count: int) -> list[socket.socket]:
    deadline = time.monotonic() + CONNECT_TIMEOUT
    peers: list[socket.socket] = []
    while len(peers) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExokvError(f"{count - len(peers)} rank(s) did not reach rank 0's doorbell")
        server.settimeout(left)
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        sock.settimeout(5.0)
        try:
            got = _read(sock, len(key))
        except OSError:
            got = b""
        if hmac.compare_digest(got, key.encode()):
            sock.settimeout(None)
            peers.append(sock)
        else:
            sock.close()
    return peers


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class PieceBell:
    """Two pipeline ranks, each piece of a prefill: rank 1 rings once its layers ran and
    its hidden state went to rank 0; rank 0 waits for that before it runs the piece, so
    its receive finds the state there. Both ranks run the same pieces (the same steps,
    cut alike), so each byte meets one wait."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock

    def before_piece(self) -> None:
        if self.rank != 0:
            return
        try:
            data = self.sock.recv(1)
        except OSError as err:
            raise ExokvError(f"lost rank 1 while waiting for it ({err})") from None
        if data != _PIECE:
            raise ExokvError("lost rank 1 while waiting for it")

    def after_piece(self) -> None:
        if self.rank == 0:
            return
        try:
            self.sock.sendall(_PIECE)
        except OSError:
            pass  # rank 0 is gone: the next collective says so
