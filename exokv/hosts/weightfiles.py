"""A model's files copied onto a host that cannot get them itself, from hosts that have them.

A host fetches the weights of its layers from its own Hugging Face cache or the hub
(exokv.hosts.fetch), and a model given as a folder is read where the ranks find it.
When a host cannot (the hub out of its reach, a folder that is not there), the front
end lends it the files from the other hosts: this module's `send` on a host that has
them, its output piped through the front end (exokv.hosts.kvfiles.pipe_between: the
hosts need not reach each other) into its `receive` on the host that lacks them. Only
the files that host's ranks load are sent (hub.Want: the config, tokenizer and index
files, and the shards of its layers), and only those it does not hold already (a file
of the same name and size: a hub snapshot's names are its commit's, and a folder's
identity is its files' names and sizes too).

Where the files land is where that host's ranks load them from:
- a folder (`--folder`): the same path, `~` being that host's home;
- a hub snapshot (`--repo`, `--commit`): the host's own Hugging Face cache, laid out as
  huggingface_hub lays it out: the content as `blobs/<its blob name on the sending
  host>`, `snapshots/<commit>/<file>` a link to it, `refs/<revision>` naming the
  commit; so the ranks (exokv.model.resolve) and a later fetch (hub._cache_only) read
  it as a snapshot of its own.

The stream is a run of frames, one per file:

    <H name length> <name> <H blob length> <blob name, or empty> <q size> <data> <I CRC-32>

A size of -1 carries no data and no CRC: the sending host lacks the file, or it failed
its check there. A frame with name length 0 ends the stream; one that stops without it
was cut short. A safetensors file is checked before it is sent and once written (its
header's tensors end where the file does), the CRC-32 of its bytes at both ends; a file
is written under a temporary name, synced and renamed: whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from exokv.cache import durable
from exokv.config import debug_enabled
from exokv.errors import ExokvError, one_line
from exokv.hosts.kvfiles import (
    CUT_SHORT,
    CutShort,
    Received,
    counts_of,
    last_line,
    make_pool,
    pipe_between,
    read_exact,
    report_received,
    where,
)
from exokv.launch import remote
from exokv.model import hub

MODULE = "exokv.hosts.weightfiles"
NAME_LENGTH = struct.Struct("<H")
SIZE = struct.Struct("<q")
CRC = struct.Struct("<I")
NO_DATA = -1
CHUNK = 1 << 20
# A hub blob's name: the git SHA-1 of a small file, the SHA-256 of an LFS one.
BLOB = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
# A safetensors header larger than this is a damaged length, not a header.
MAX_HEADER = 100 * 2**20
FAILED, BAD_ARGUMENT = 1, 2
# Listing a host's files is quick; a model's copy is bounded by the hub fetch's own bound.
ASK_TIMEOUT_S = 60.0
COPY_TIMEOUT_S = 12 * 3600.0


# -- where a model's files are on a host -------------------------------------------------


@dataclass(frozen=True)
class Place:
    """A model's files on a host: a folder (as the ranks name it: `~` is that host's
    home), or a hub repo's snapshot at `commit` in that host's Hugging Face cache."""

    folder: str | None = None
    repo: str | None = None
    commit: str | None = None
    revision: str | None = None  # the name the ranks look the commit up by (refs/)

    def args(self) -> list[str]:
        if self.folder is not None:
            return ["--folder", self.folder]
        assert self.repo is not None and self.commit is not None
        return ["--repo", self.repo, "--commit", self.commit, "--revision", self.revision or ""]

    def root(self) -> Path:
        """The folder the ranks of this host load from."""
        if self.folder is not None:
            return Path(self.folder).expanduser()
        assert self.repo is not None and self.commit is not None
        return hub.snapshot_dir(self.repo, self.commit)

    def blobs(self) -> Path | None:
        return None if self.repo is None else hub.storage_dir(self.repo) / "blobs"

    @property
    def name(self) -> str:
        return self.repo or self.folder or ""


def folder_place(model: str) -> Place:
    """A --model that is a folder here, named as the ranks on a host resolve it: `~` on
    that host, a relative path from this machine's working folder (mlx.launch starts
    the ranks there)."""
    text = model.strip()
    return Place(folder=text if text.startswith("~") else os.path.abspath(text))


def valid_name(name: str) -> bool:
    """A model file's name: one plain name in the folder, never a path or a hidden file."""
    return (
        bool(name)
        and not name.startswith(".")
        and not set(name) & set("/\\\0")
        and len(name.encode()) < 2**16
    )


# -- on a host: what it holds ------------------------------------------------------------


def held(place: Place) -> tuple[dict[str, int], dict[str, str]]:
    """The files of the model's folder on this host with their sizes (a link to a missing
    blob is not held), and for those that are links to hub blobs, the blob's name."""
    root = place.root()
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return {}, {}
    files: dict[str, int] = {}
    blobs: dict[str, str] = {}
    for entry in entries:
        if not valid_name(entry.name):
            continue
        try:
            if not entry.is_file():
                continue
            files[entry.name] = entry.stat().st_size
            if entry.is_symlink():
                target = Path(os.readlink(entry))
                if target.parent.name == "blobs" and BLOB.match(target.name):
                    blobs[entry.name] = target.name
        except OSError:
            continue  # removed since the listing, or unreadable: not held
    return files, blobs


def needed(place: Place, want: hub.Want) -> list[str] | None:
    """The files the ranks `want` describes load, as this host's copy of the model says
    (its config and index); None when it has no config to tell."""
    root = place.root()
    if not (root / "config.json").is_file():
        return None
    listing = None
    if place.repo is not None and place.commit is not None:
        listing = hub.read_listing(place.repo, place.commit)
    return want.files(listing or hub.folder_listing(root), root)


# -- on a host: send -----------------------------------------------------------------------


def safetensors_whole(f: BinaryIO, size: int) -> bool:
    """Whether the safetensors file `f` (`size` bytes) is whole: its header reads, and
    its tensors end where the file does (a file cut short fails)."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        return False
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER or 8 + length > size:
        return False
    try:
        header = json.loads(f.read(length))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    return 8 + length + max(ends, default=0) == size


def checked(name: str, f: BinaryIO, size: int) -> bool:
    return not name.endswith(".safetensors") or safetensors_whole(f, size)


def head(name: str, blob: str, size: int) -> bytes:
    encoded, tag = name.encode(), blob.encode()
    return (
        NAME_LENGTH.pack(len(encoded))
        + encoded
        + NAME_LENGTH.pack(len(tag))
        + tag
        + SIZE.pack(size)
    )


class ShortRead(Exception):
    """A file grew shorter while it was sent: the stream is ended without its end frame."""


def send_one(root: Path, name: str, blob: str, out: BinaryIO) -> None:
    """`name`'s frame: its data streamed in pieces, then its CRC-32."""
    try:
        f = open(root / name, "rb") if valid_name(name) else None  # noqa: SIM115 - closed below
    except OSError:
        f = None
    if f is None:
        out.write(head(name, "", NO_DATA))
        return
    with f:
        size = os.fstat(f.fileno()).st_size
        if not checked(name, f, size):
            out.write(head(name, "", NO_DATA))
            return
        f.seek(0)
        out.write(head(name, blob, size))
        crc, left = 0, size
        while left:
            piece = f.read(min(CHUNK, left))
            if not piece:
                raise ShortRead(f"{name} ended {left} bytes before its size")
            crc = zlib.crc32(piece, crc)
            out.write(piece)
            left -= len(piece)
        out.write(CRC.pack(crc))
        out.flush()


def send(place: Place, names: Sequence[str], out: BinaryIO) -> None:
    _, blobs = held(place)
    root = place.root()
    for name in names:
        send_one(root, name, blobs.get(name, ""), out)
    out.write(NAME_LENGTH.pack(0))
    out.flush()


# -- on a host: receive --------------------------------------------------------------------


def next_head(stream: BinaryIO) -> tuple[bytes, bytes, int] | None:
    """The next frame's (name, blob, size), or None at the end frame."""
    (length,) = NAME_LENGTH.unpack(read_exact(stream, NAME_LENGTH.size))
    if length == 0:
        return None
    name = read_exact(stream, length)
    (blob_length,) = NAME_LENGTH.unpack(read_exact(stream, NAME_LENGTH.size))
    blob = read_exact(stream, blob_length)
    (size,) = SIZE.unpack(read_exact(stream, SIZE.size))
    if size < NO_DATA:
        raise CutShort(f"a damaged frame (size {size}): the rest cannot be read")
    return name, blob, size


def text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return ""


def copy_into(stream: BinaryIO, size: int, sink: BinaryIO | None) -> int:
    """`size` bytes of `stream` into `sink` (None: dropped); their CRC-32."""
    crc, left = 0, size
    while left:
        piece = stream.read(min(CHUNK, left))
        if not piece:
            raise CutShort(f"the stream stopped {left} bytes before a file's end")
        crc = zlib.crc32(piece, crc)
        if sink is not None:
            sink.write(piece)
        left -= len(piece)
    return crc


def destination(place: Place, name: str, blob: str) -> Path:
    """Where a file's content is written: its hub blob, else the folder itself."""
    blobs = place.blobs()
    if blobs is not None and BLOB.match(blob):
        return blobs / blob
    return place.root() / name


def link_into(root: Path, name: str, blob: str) -> None:
    """`root/name` a link to the blob, relative as huggingface_hub makes it, put in
    place whole (renamed over whatever was there)."""
    tmp = root / f".{name}.{os.getpid()}.link"
    tmp.unlink(missing_ok=True)
    os.symlink(f"../../blobs/{blob}", tmp)
    os.replace(tmp, root / name)
    durable.sync_dir(root)


def receive_one(place: Place, name: str, blob: str, size: int, stream: BinaryIO) -> bool:
    """One frame's data written where the ranks load it; False (nothing written) if it
    fails its CRC or its check."""
    final = destination(place, name, blob)
    if not final.parent.is_dir():
        make_pool(final.parent)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w+b") as f:
            crc = copy_into(stream, size, f)
            (sent,) = CRC.unpack(read_exact(stream, CRC.size))
            f.flush()
            if crc != sent or not checked(name, f, size):
                return False
            durable.sync_file(f.fileno())
        durable.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    if final.name != name:
        root = place.root()
        if not root.is_dir():
            make_pool(root)
        link_into(root, name, blob)
    return True


def receive(place: Place, stream: BinaryIO, counts: Received) -> None:
    """Every frame of `stream` written where this host's ranks load the model, counted in
    `counts` as it goes; then, for a hub snapshot, its revision names its commit."""
    while (got := next_head(stream)) is not None:
        raw, raw_blob, size = got
        name, blob = text(raw), text(raw_blob)
        if size == NO_DATA:
            counts.missing += 1
        elif not valid_name(name):
            copy_into(stream, size, None)
            read_exact(stream, CRC.size)
            counts.bad += 1
        elif receive_one(place, name, blob, size, stream):
            counts.written += 1
            counts.bytes += size
        else:
            counts.bad += 1
    # The revision names the commit only once its snapshot holds all that was sent.
    whole = counts.bad == counts.missing == 0
    if whole and place.repo is not None and place.commit is not None and place.revision:
        hub.write_ref(place.repo, place.revision, place.commit)


# -- on a host: the command line -------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=MODULE, description="a model's files on this host")
    sub = top.add_subparsers(dest="command", required=True)
    commands = {
        "have": "print the files held and those the given ranks load, as JSON",
        "send": "write the named files to stdout as frames",
        "receive": "write the frames on stdin where this host's ranks load the model",
    }
    for command, helped in commands.items():
        one = sub.add_parser(command, help=helped)
        one.add_argument("--folder", default=None, help="a model folder (~: this host's home)")
        one.add_argument("--repo", default=None, help="a hub repo (org/name)")
        one.add_argument("--commit", default=None)
        one.add_argument("--revision", default=None, help="the name refs/ keeps the commit by")
        if command == "have":
            one.add_argument("--ranks", type=int, default=1)
            one.add_argument("--host-ranks", default="0")
            one.add_argument("--split", default=None)
            one.add_argument("--parallel", default="pipeline")
        if command == "send":
            one.add_argument("names", nargs="*")
    return top


def place_of(args: argparse.Namespace) -> Place:
    """The place the arguments name; ValueError unless they name exactly one, well."""
    if (args.folder is None) == (args.repo is None):
        raise ValueError("give --folder or --repo with --commit")
    if args.repo is not None and (
        hub.parse_name(args.repo) is None
        or "@" in args.repo
        or not hub.COMMIT.match(args.commit or "")
    ):
        raise ValueError(f"not a hub repo and commit: {args.repo!r} {args.commit!r}")
    if args.revision and not hub.parse_name(f"{args.repo}@{args.revision}"):
        raise ValueError(f"not a revision: {args.revision!r}")
    return Place(args.folder, args.repo, args.commit, args.revision or None)


def want_from(want_args: Sequence[str]) -> hub.Want:
    """The ranks `have`'s arguments describe (--ranks N --host-ranks 0,2 ...)."""
    return want_of(parser().parse_args(["have", "--folder", ".", *want_args]))


def want_of(args: argparse.Namespace) -> hub.Want:
    return hub.Want(
        ranks=args.ranks,
        host_ranks=[int(r) for r in args.host_ranks.split(",")] if args.host_ranks else None,
        split=[int(n) for n in args.split.split(",")] if args.split else None,
        parallel=args.parallel,
    )


def run_have(place: Place, want: hub.Want) -> int:
    files, blobs = held(place)
    print(json.dumps({"files": files, "blobs": blobs, "needed": needed(place, want)}), flush=True)
    return 0


def run_send(place: Place, names: Sequence[str]) -> int:
    try:
        send(place, names, sys.stdout.buffer)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{MODULE}: the receiving side stopped reading", file=sys.stderr)
        return CUT_SHORT
    except ShortRead as err:
        print(f"{MODULE}: {err}", file=sys.stderr)
        return FAILED
    return 0


def run_receive(place: Place) -> int:
    return report_received(lambda stream, counts: receive(place, stream, counts))


def main(argv: list[str] | None = None) -> int:
    """One subcommand on this host; an expected failure is one line on stderr."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        place = place_of(args)
        want = want_of(args) if args.command == "have" else None
    except ValueError as err:
        print(f"{MODULE}: {err}", file=sys.stderr)
        return BAD_ARGUMENT
    try:
        if want is not None:
            return run_have(place, want)
        if args.command == "send":
            return run_send(place, args.names)
        return run_receive(place)
    except OSError as err:
        if debug_enabled():
            raise
        print(f"{MODULE} {args.command}: {one_line(err, named=False)}", file=sys.stderr)
        return FAILED


# -- on the front end -----------------------------------------------------------------------


@dataclass
class Holding:
    """What one host holds of a model; `error` (one line) when it could not be asked."""

    files: dict[str, int] = field(default_factory=dict)
    needed: list[str] | None = None
    error: str = ""


def ask(host: str | None, place: Place, want_args: Sequence[str], envs: Sequence[str]) -> Holding:
    """What `host` (None: this machine) holds of the model at `place`, and which files
    ranks with `want_args` (--ranks, --host-ranks, ...) load by its copy of the model."""
    run = remote.run_module(
        host, MODULE, ["have", *place.args(), *want_args], timeout=ASK_TIMEOUT_S, envs=envs
    )
    if run.ok:
        try:
            said = json.loads(last_line(run.stdout))
            files = {str(k): int(v) for k, v in said["files"].items()}
            wanted = said["needed"]
            return Holding(files, None if wanted is None else [str(n) for n in wanted])
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    why = run.error or last_line(run.stderr) or f"no answer (exit status {run.returncode})"
    return Holding(error=f"could not ask {where(host)} what it holds: {why}")


def complete(holding: Holding) -> bool:
    """Whether a host holds every file its own copy of the model says its ranks load."""
    return holding.needed is not None and all(n in holding.files for n in holding.needed)


def plan_copies(
    wanted: Sequence[str], target: dict[str, int], sources: Sequence[tuple[str | None, Holding]]
) -> tuple[dict[str | None, list[str]], list[str]]:
    """Which source sends which of `wanted` files to a host holding `target`: each file
    the host lacks (or holds at another size) from the first source holding it; and
    the files no source holds."""
    copies: dict[str | None, list[str]] = {}
    nowhere: list[str] = []
    for name in wanted:
        holders = [(host, h.files[name]) for host, h in sources if name in h.files]
        if not holders:
            nowhere.append(name)
        elif target.get(name) != holders[0][1]:
            copies.setdefault(holders[0][0], []).append(name)
    return copies, nowhere


@dataclass
class Lent:
    """What `lend` copied onto one host."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    sources: list[str] = field(default_factory=list)  # the hosts it came from, by name


def lend(
    target: str,
    place: Place,
    want_args: Sequence[str],
    sources: Sequence[str | None],
    envs: Sequence[str] = (),
    why: str = "",
    known: Mapping[str | None, Holding] | None = None,
    wanted: list[str] | None = None,
) -> Lent:
    """The files of `place` that host `target`'s ranks (`want_args`) load and it lacks,
    copied to it from `sources` (None: this machine), the first holding each file.
    `why` says why `target` could not get them itself. Raises ExokvError (one line)
    naming the host, the files it lacks and why, when they cannot all be copied.

    `known`: what hosts were found to hold already (not asked again); `wanted`: the
    files `target`'s ranks load, when the caller knows (else the sources' copies of
    the model say)."""
    others = [s for s in dict.fromkeys(sources) if s != target]
    holdings = dict(known or {}) if wanted is not None else {}
    unasked = [h for h in [target, *others] if h not in holdings]
    if unasked:
        with ThreadPoolExecutor(max_workers=len(unasked)) as pool:
            asked = pool.map(lambda h: ask(h, place, want_args, envs), unasked)
            holdings.update(zip(unasked, asked, strict=True))
    mine, theirs = holdings[target], [(h, holdings[h]) for h in others]
    if mine.error:
        raise ExokvError(f"{target} cannot get the files of {place.name}: {why or mine.error}")
    if wanted is None:
        wanted = next((h.needed for _, h in theirs if h.needed is not None), None)
    if wanted is None:
        raise _lacks(target, place, ["config.json"], why, "no host that answers has the model")
    copies, nowhere = plan_copies(wanted, mine.files, theirs)
    if nowhere:
        raise _lacks(target, place, nowhere, why, "no host that answers holds them")
    lent = Lent()
    for src, names in copies.items():
        piped = pipe_between(
            src,
            target,
            MODULE,
            ["send", *place.args(), *names],
            ["receive", *place.args()],
            envs,
            timeout=COPY_TIMEOUT_S,
        )
        counts = counts_of(piped.out) or Received()
        lent.files += counts.written
        lent.bytes += counts.bytes
        lent.seconds += piped.seconds
        lent.sources.append(where(src))
        if piped.error or counts.written < len(names):
            problem = piped.error or (
                f"{counts.missing} not readable there, {counts.bad} damaged on the way"
            )
            raise _lacks(target, place, names, why, f"copying from {where(src)} failed: {problem}")
    return lent


def file_count(count: int) -> str:
    return f"{count} file" + ("" if count == 1 else "s")


def _lacks(target: str, place: Place, names: Sequence[str], why: str, how: str) -> ExokvError:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    because = f" ({why})" if why else ""
    return ExokvError(
        f"{target} lacks {file_count(len(names))} of {place.name} ({shown}) it cannot get itself"
        f"{because}, and {how}"[:600]
    )


if __name__ == "__main__":
    sys.exit(main())
