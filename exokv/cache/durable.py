"""Writes that survive a power cut: a file's bytes, and its new name, on the disk itself.

An fsync of a file does not make a rename of it durable: the name lives in the
directory, which needs an fsync of its own after `os.replace`. On macOS fsync hands
the data to the drive, whose cache a power cut empties; F_FULLFSYNC has the drive
write its cache out, as SQLite's `fullfsync` does for the state database.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

# A file system that cannot sync a directory says so with one of these: nothing more to do.
_NO_DIRECTORY_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def sync_file(fd: int) -> None:
    """The open file `fd`'s data on the disk (F_FULLFSYNC on macOS, else fsync)."""
    if sys.platform == "darwin":
        import fcntl  # deferred: POSIX only, and F_FULLFSYNC is for macOS alone

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # a file system without it (some network mounts): fsync is what there is
    os.fsync(fd)


def sync_dir(path: Path) -> None:
    """The directory `path`'s entries (a rename into it, a file made in it) on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        sync_file(fd)
    except OSError as err:
        if err.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(fd)


def replace(tmp: Path, final: Path) -> None:
    """`os.replace(tmp, final)` that a power cut does not undo (`tmp` already synced)."""
    os.replace(tmp, final)
    sync_dir(final.parent)
