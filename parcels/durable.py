"""Durability on a POSIX file system: the one "fsync this path" helper of the Python packages.

A write is durable once the file's data is fsync()ed and, for a new or renamed name, once its directory
is fsync()ed too. For a file on a FUSE mount (vulpes's images) fsync also asks the daemon to make what it
holds durable.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    """fsync() the file or directory at ``path``. A file system that cannot sync a directory (EINVAL) has
    nothing more to make durable there. Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not os.path.isdir(path):
            raise
    finally:
        os.close(fd)
