"""KV files listed, sent and received on a host, and copied from one host to another.

A replica of a rank's KV (exokv.hosts.replicas) is the same files in the same pool on a
second host. Hosts may not reach each other, but the front end reaches every one over
plain `ssh HOST CMD` (exokv.launch.remote); so a copy is this module's `send` on one
host with its output piped, through the front end, into its `receive` on the other.
This module runs on the hosts too: it imports neither mlx nor exokv.cache.disk, and
starts in a fraction of a second.

The stream `send` writes and `receive` reads is a run of frames, one per file:

    <H name length> <name, UTF-8> <q data length> <data: the whole file>

A data length of -1 carries no data: the file did not appear in time, or failed its
check on the sending host. A frame with name length 0 (and nothing after it) ends the
stream; a stream that stops without it was cut short. Each file is checked (magic,
length, CRC-32 of the body) before it is sent and again when it arrives, and is written
as the disk tier writes its own: under a temporary name, synced, renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from exokv.cache import durable
from exokv.config import debug_enabled
from exokv.errors import ExokvError, one_line
from exokv.hosts.replicas import file_name, parse_file_name
from exokv.launch import remote
from exokv.state.store import caches_dir

MODULE = "exokv.hosts.kvfiles"
# A KV file's header, as exokv.cache.disk writes it (that module imports mlx: a host
# answering here must not wait for it). tests/test_kvfiles.py holds the two equal.
MAGIC = b"EXKV"
HEADER = struct.Struct("<4sIQ")  # magic, crc32 of the body, body length
NAME_LENGTH = struct.Struct("<H")
DATA_LENGTH = struct.Struct("<q")
NO_DATA = -1
POLL_S = 0.05  # how often `send` looks again for a file the rank may still be writing
CHUNK = 1 << 20  # `receive` reads a file's data in pieces of this size at most
# Exit statuses: 1 a failure on this host (an unreadable folder, a full disk), 2 a bad
# argument, 3 the other end of the stream went away (its own failure is the cause).
FAILED, BAD_ARGUMENT, CUT_SHORT = 1, 2, 3


# -- on a host: checks ----------------------------------------------------------------


def checked_rel(rel: str) -> PurePosixPath:
    """`rel` as a pool's folder under the KV folder; ValueError unless it is one: a pool
    is all a host gives out or takes in, never a path anywhere else on its disk."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"not a relative path inside the KV folder: {rel!r}")
    if not path.name.startswith("pool-"):
        raise ValueError(f"not a pool folder (its last part starts with pool-): {rel!r}")
    return path


def valid_name(name: str) -> bool:
    """A KV file's name exactly as exokv.hosts.replicas writes it (so never a path)."""
    try:
        parsed = parse_file_name(name)
    except ValueError:  # a digit str.isdigit takes and int() does not ("²")
        return False
    return parsed is not None and file_name(*parsed) == name


def intact(data: bytes) -> bool:
    """Whether `data` is a whole KV file: its magic, its body's length and CRC-32."""
    if len(data) < HEADER.size:
        return False
    magic, crc, length = HEADER.unpack_from(data)
    body = memoryview(data)[HEADER.size :]
    return magic == MAGIC and len(body) == length and zlib.crc32(body) == crc


# -- on a host: list -------------------------------------------------------------------


def listed(pool: Path) -> dict[str, int]:
    """Each KV file in `pool` and its size; a pool not made yet holds none."""
    try:
        entries = list(pool.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    files: dict[str, int] = {}
    for entry in entries:
        if not valid_name(entry.name):
            continue
        try:
            files[entry.name] = entry.stat().st_size
        except FileNotFoundError:
            pass  # removed since the listing: not there
    return dict(sorted(files.items()))


# -- on a host: send -------------------------------------------------------------------


def frame(name: str, data: bytes | None) -> bytes:
    """One file's frame (`data` None: sent without data)."""
    encoded = name.encode()
    length = NO_DATA if data is None else len(data)
    return NAME_LENGTH.pack(len(encoded)) + encoded + DATA_LENGTH.pack(length) + (data or b"")


def end_frame() -> bytes:
    return NAME_LENGTH.pack(0)


def appeared(path: Path, deadline: float) -> bool:
    """Whether `path` exists by `deadline` (monotonic): the rank's writer may still be
    writing it, and renames it into place whole."""
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def file_data(pool: Path, name: str, deadline: float) -> bytes | None:
    """`name`'s whole file if it is a KV file's name, appears by `deadline` and checks
    out; else None (sent without data)."""
    if not valid_name(name):
        return None
    path = pool / name
    if not appeared(path, deadline):
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None  # removed since (the disk tier's eviction): not there
    return data if intact(data) else None


def send(pool: Path, names: Sequence[str], wait: float, out: BinaryIO) -> None:
    """Each of `names` from `pool` as a frame on `out`, then the end frame; `wait`
    seconds is one deadline for all of them together, not a wait for each."""
    deadline = time.monotonic() + max(0.0, wait)
    for name in names:
        out.write(frame(name, file_data(pool, name, deadline)))
        out.flush()  # the receiver writes this file while the next one is looked for
    out.write(end_frame())
    out.flush()


# -- on a host: receive ----------------------------------------------------------------


class CutShort(Exception):
    """The stream stopped before its end frame: the sending side went away."""


@dataclass
class Received:
    """What `receive` did with the frames it read (printed as its one JSON line)."""

    written: int = 0
    bytes: int = 0
    skipped: int = 0  # already there, the same (two hosts on one disk, a copy redone)
    bad: int = 0  # damaged on the way, or not a KV file's name
    missing: int = 0  # sent without data: not on the sending host in time, or damaged there

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def read_exact(stream: BinaryIO, size: int) -> bytes:
    """`size` bytes of `stream` (in pieces: a damaged length asks for no huge buffer)."""
    data = bytearray()
    while len(data) < size:
        piece = stream.read(min(CHUNK, size - len(data)))
        if not piece:
            raise CutShort(f"the stream stopped after {len(data)} of {size} bytes")
        data += piece
    return bytes(data)


def next_frame(stream: BinaryIO) -> tuple[bytes, bytes | None] | None:
    """The next frame's (name, data or None), or None at the end frame."""
    head = stream.read(NAME_LENGTH.size)
    if not head:
        raise CutShort("the stream stopped before its end")
    if len(head) < NAME_LENGTH.size:
        head += read_exact(stream, NAME_LENGTH.size - len(head))
    (name_length,) = NAME_LENGTH.unpack(head)
    if name_length == 0:
        return None
    name = read_exact(stream, name_length)
    (length,) = DATA_LENGTH.unpack(read_exact(stream, DATA_LENGTH.size))
    if length < NO_DATA:
        raise CutShort(f"a damaged frame (data length {length}): the rest cannot be read")
    return name, None if length == NO_DATA else read_exact(stream, length)


def decoded(name: bytes) -> str | None:
    try:
        text = name.decode()
    except UnicodeDecodeError:
        return None
    return text if valid_name(text) else None


def same_header(path: Path, data: bytes) -> bool:
    """Whether `path` holds the file `data` is already: the header carries its CRC-32."""
    try:
        with open(path, "rb") as f:
            return f.read(HEADER.size) == data[: HEADER.size]
    except FileNotFoundError:
        return False


def make_pool(pool: Path) -> None:
    """`pool` and its missing parents, each new folder's name synced into its parent."""
    missing = [p for p in (pool, *pool.parents) if not p.exists()]
    pool.mkdir(parents=True, exist_ok=True)
    for folder in reversed(missing):
        durable.sync_dir(folder.parent)


def write_file(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all, through a power cut too."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            durable.sync_file(f.fileno())
        durable.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def receive(pool: Path, stream: BinaryIO, counts: Received) -> None:
    """Every frame of `stream` written into `pool`, counted in `counts` as it goes (so a
    stream cut short, or a full disk, still says what was written before)."""
    while (got := next_frame(stream)) is not None:
        raw, data = got
        name = decoded(raw)
        if data is None:
            counts.missing += 1
        elif name is None or not intact(data):
            counts.bad += 1
        elif same_header(pool / name, data):
            counts.skipped += 1
        else:
            if not pool.is_dir():
                make_pool(pool)
            write_file(pool / name, data)
            counts.written += 1
            counts.bytes += len(data)


# -- on a host: the command line -------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=MODULE, description="KV files of one pool on this host")
    sub = top.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="print the pool's KV files and sizes as JSON")
    listing.add_argument("rel", help="the pool's folder under the KV folder")
    sending = sub.add_parser("send", help="write the named files to stdout as frames")
    sending.add_argument("rel")
    sending.add_argument("--wait", type=float, default=0.0, help="seconds, for all names")
    sending.add_argument("names", nargs="*")
    receiving = sub.add_parser("receive", help="write the frames on stdin into the pool")
    receiving.add_argument("rel")
    pools = sub.add_parser("pools", help="print every pool of a model's tiers, as JSON")
    pools.add_argument("prefix", help="how the model's folder names begin")
    pools.add_argument("layout", help="the tiers' layout folder (pipeline-kv16g64-max0)")
    return top


def parsed(argv: list[str]) -> argparse.Namespace:
    """`argv` read; the names `send` is given after its --wait are its names too
    (argparse ends a positional list at the first option)."""
    top = parser()
    args, extra = top.parse_known_args(argv)
    unknown = [a for a in extra if args.command != "send" or a.startswith("-")]
    if unknown:
        top.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "send":
        args.names = [*args.names, *extra]
    return args


def run_list(pool: Path) -> int:
    print(json.dumps({"files": listed(pool)}), flush=True)
    return 0


def run_send(pool: Path, names: Sequence[str], wait: float) -> int:
    try:
        send(pool, names, wait, sys.stdout.buffer)
    except BrokenPipeError:
        # Python would report the broken pipe again flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{MODULE}: the receiving side stopped reading", file=sys.stderr)
        return CUT_SHORT
    return 0


def run_receive(pool: Path) -> int:
    return report_received(lambda stream, counts: receive(pool, stream, counts))


def report_received(receiving: Callable[[BinaryIO, Received], None]) -> int:
    """Run `receiving` on standard input and print what it counted as one JSON line,
    whole or cut short (the sending side reads it); the exit code says which."""
    counts = Received()
    try:
        receiving(sys.stdin.buffer, counts)
    except CutShort as err:
        print(counts.to_json(), flush=True)
        print(f"{MODULE}: {err}", file=sys.stderr)
        return CUT_SHORT
    except OSError:
        print(counts.to_json(), flush=True)
        raise
    print(counts.to_json(), flush=True)
    return 0


def pools_of(prefix: str, layout: str) -> dict[str, dict[str, int]]:
    """Every pool of the tiers whose model folder begins with `prefix`, by its folder
    under the KV folder, with its files (a start on other hosts moves them: any
    lineage here may be the one a rank's tree names)."""
    out = {}
    root = caches_dir()
    for pool in sorted(root.glob(f"*/{layout}/pool-*")):
        if pool.parent.parent.name.startswith(prefix) and pool.is_dir():
            out[pool.relative_to(root).as_posix()] = listed(pool)
    return out


def _plain(word: str) -> bool:
    """A folder name's part: no separator, no glob character, not `..`."""
    return bool(word) and word not in (".", "..") and not set(word) & set("/\\*?[]")


def main(argv: list[str] | None = None) -> int:
    """One subcommand on this host; an expected failure is one line on stderr."""
    args = parsed(sys.argv[1:] if argv is None else argv)
    if args.command == "pools":
        if not (_plain(args.prefix) and _plain(args.layout)):
            print(f"{MODULE}: pools: a plain folder name is needed", file=sys.stderr)
            return BAD_ARGUMENT
        print(json.dumps({"pools": pools_of(args.prefix, args.layout)}), flush=True)
        return 0
    try:
        pool = caches_dir() / checked_rel(args.rel)
    except ValueError as err:
        print(f"{MODULE}: {err}", file=sys.stderr)
        return BAD_ARGUMENT
    try:
        if args.command == "list":
            return run_list(pool)
        if args.command == "send":
            return run_send(pool, args.names, args.wait)
        return run_receive(pool)
    except OSError as err:
        if debug_enabled():
            raise
        print(f"{MODULE} {args.command}: {one_line(err, named=False)}", file=sys.stderr)
        return FAILED


# -- on the front end --------------------------------------------------------------------


def where(host: str | None) -> str:
    return host or "this machine"


def last_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def list_files(
    host: str | None, rel: str, envs: Sequence[str] = (), timeout: float = 30
) -> dict[str, int]:
    """The KV files of pool `rel` on `host` (None: here) and their sizes: what a replica
    already holds, so a copy sends only the rest. ExokvError (one line) if it cannot."""
    run = remote.run_module(host, MODULE, ["list", rel], timeout=timeout, envs=envs)
    if run.ok:
        try:
            files = json.loads(last_line(run.stdout))["files"]
            return {str(k): int(v) for k, v in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    why = run.error or last_line(run.stderr) or f"no listing (exit status {run.returncode})"
    raise ExokvError(f"could not list the KV files on {where(host)}: {why}")


def list_pools(
    host: str | None, prefix: str, layout: str, envs: Sequence[str] = (), timeout: float = 30
) -> dict[str, dict[str, int]]:
    """Every pool on `host` of the tiers of models whose folder begins with `prefix`,
    with its files (exokv.client.replan moves them); {} when the host cannot say."""
    run = remote.run_module(host, MODULE, ["pools", prefix, layout], timeout=timeout, envs=envs)
    try:
        pools = json.loads(last_line(run.stdout))["pools"] if run.ok else {}
        return {str(r): {str(k): int(v) for k, v in f.items()} for r, f in pools.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


@dataclass
class Copied:
    """What one copy did; `error` (one line) says why it stopped short, "" when it did not.

    `files` and `bytes` count the files written; `skipped` were there already, the same;
    `missing` never reached the sending side in time (or failed its check there); `bad`
    were damaged on the way."""

    files: int
    bytes: int
    seconds: float
    error: str = ""
    skipped: int = 0
    missing: int = 0
    bad: int = 0
    cancelled: bool = False  # ended by its caller's `cancel` (it is to be run again)


def copy_files(
    src: str | None,
    dst: str | None,
    rel: str,
    names: Sequence[str],
    envs: Sequence[str] = (),
    wait: float = 10.0,
    timeout: float = 300.0,
    cancel: threading.Event | None = None,
) -> Copied:
    """`names` of pool `rel` copied from host `src` to host `dst` (None: this machine),
    through this machine: hosts may not reach each other. Never raises for a failed
    copy (a replica that could not be made must not end a chat): `error` says why.

    `wait` is how long, all names together, `src` waits for files its rank is still
    writing; the whole copy is ended after `timeout` seconds, or as soon as `cancel` is
    set (`cancelled`: what was written is whole, the rest is for another try)."""
    if not names or src == dst:
        return Copied(0, 0, 0.0)
    send_args = ["send", rel, "--wait", f"{wait:g}", *names]
    piped = pipe_between(
        src, dst, MODULE, send_args, ["receive", rel], envs, timeout=timeout, cancel=cancel
    )
    copied = _copied(counts_of(piped.out), piped.seconds, piped.error)
    copied.cancelled = piped.cancelled
    return copied


@dataclass
class Piped:
    """What one `send` on a host piped into one `receive` on another left behind."""

    out: bytes  # what the receiving side printed (its counts, as one JSON line)
    seconds: float
    error: str = ""  # one line: why it stopped short; "" when both ended well
    cancelled: bool = False


def pipe_between(
    src: str | None,
    dst: str | None,
    module: str,
    send_args: Sequence[str],
    receive_args: Sequence[str],
    envs: Sequence[str] = (),
    *,
    timeout: float,
    cancel: threading.Event | None = None,
) -> Piped:
    """`module` with `send_args` on host `src`, its stdout piped through this machine into
    `module` with `receive_args` on host `dst` (None: this machine), both over ssh; ended
    after `timeout` seconds or once `cancel` is set. Never raises: `error` says why.
    exokv.hosts.weightfiles streams a model's files the same way."""
    started = time.monotonic()
    sender_cmd = remote.module_command(src, module, send_args, envs)
    receiver_cmd = remote.module_command(dst, module, receive_args, envs)
    try:
        sender, receiver = _start_pipe(sender_cmd, receiver_cmd)
    except OSError as err:
        return Piped(b"", time.monotonic() - started, f"could not start a copy: {err}")
    outputs = _drain(sender, receiver)
    ended = _ended_by(sender, receiver, started + timeout, cancel)
    for reader in outputs.readers:
        reader.join(timeout=5)
    out = b"".join(outputs.receiver_out)
    if not ended and cancel is not None and cancel.is_set():
        return Piped(out, time.monotonic() - started, "cancelled", cancelled=True)
    if not ended:
        error = f"the copy from {where(src)} to {where(dst)} took over {timeout:.0f} s: ended"
    else:
        error = _failure(
            ("send", src, sender, outputs.sender_err),
            ("receive", dst, receiver, outputs.receiver_err),
        )
    if not error and counts_of(out) is None:
        error = f"receive on {where(dst)} said nothing of what it wrote"
    return Piped(out, time.monotonic() - started, error)


def _start_pipe(
    sender_cmd: tuple[list[str], dict[str, str]], receiver_cmd: tuple[list[str], dict[str, str]]
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """The sender, its stdout piped straight into the receiver's stdin (this process
    keeps no copy of the pipe: the receiver stopping ends the sender's writes)."""
    sender = _start(sender_cmd, subprocess.DEVNULL)
    assert sender.stdout is not None
    try:
        receiver = _start(receiver_cmd, sender.stdout)
    except OSError:
        _kill(sender)
        sender.wait()
        raise
    finally:
        sender.stdout.close()
    return sender, receiver


def _start(command: tuple[list[str], dict[str, str]], stdin: object) -> subprocess.Popen[bytes]:
    argv, env = command
    return subprocess.Popen(
        argv,
        stdin=stdin,  # type: ignore[arg-type]
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # a Ctrl-C at the front end is the front end's to handle
    )


@dataclass
class _Outputs:
    sender_err: list[bytes]
    receiver_out: list[bytes]
    receiver_err: list[bytes]
    readers: list[threading.Thread]


def _drain(sender: subprocess.Popen[bytes], receiver: subprocess.Popen[bytes]) -> _Outputs:
    """Threads reading what the two write besides the stream (a full stderr pipe would
    stop a process)."""
    outputs = _Outputs([], [], [], [])
    for stream, sink in (
        (sender.stderr, outputs.sender_err),
        (receiver.stdout, outputs.receiver_out),
        (receiver.stderr, outputs.receiver_err),
    ):
        assert stream is not None
        reader = threading.Thread(target=lambda s=stream, k=sink: k.extend(s), daemon=True)
        reader.start()
        outputs.readers.append(reader)
    return outputs


def _ended_by(
    sender: subprocess.Popen[bytes],
    receiver: subprocess.Popen[bytes],
    deadline: float,
    cancel: threading.Event | None = None,
) -> bool:
    """Whether both ended by `deadline` (monotonic) and before `cancel` was set; if not,
    both are killed."""
    while time.monotonic() < deadline and not (cancel is not None and cancel.is_set()):
        if sender.poll() is not None and receiver.poll() is not None:
            return True
        time.sleep(POLL_S)
    if sender.poll() is not None and receiver.poll() is not None:
        return True
    for proc in (sender, receiver):
        _kill(proc)
    for proc in (sender, receiver):
        proc.wait()
    return False


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """`proc` and what it started in its session (here: the module under `sh`)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()


def _failure(
    *sides: tuple[str, str | None, subprocess.Popen[bytes], list[bytes]],
) -> str:
    """One line for the side that failed first in cause: a side that only saw the other
    go away (exit status CUT_SHORT) is named only when no other side failed."""
    failed = [s for s in sides if s[2].returncode != 0]
    failed.sort(key=lambda s: s[2].returncode == CUT_SHORT)
    if not failed:
        return ""
    role, host, proc, err = failed[0]
    line = last_line(b"".join(err).decode(errors="replace"))
    return f"{role} on {where(host)}: {line or f'exit status {proc.returncode}'}"


def counts_of(out: bytes) -> Received | None:
    """The counts a `receive` printed as its last line; None if it printed none."""
    try:
        said = json.loads(last_line(out.decode(errors="replace")))
        return Received(**{f.name: int(said[f.name]) for f in fields(Received)})
    except (ValueError, KeyError, TypeError):
        return None


def _copied(counts: Received | None, seconds: float, error: str) -> Copied:
    counts = counts or Received()
    return Copied(
        counts.written, counts.bytes, seconds, error, counts.skipped, counts.missing, counts.bad
    )


if __name__ == "__main__":
    sys.exit(main())
