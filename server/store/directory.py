"""The directory object store: the parcel store layout on a local file system.

Every object is written as a temporary file under ``ROOT/tmp``, fsynced, renamed into place, and its
directory fsynced (doc/parcel-format.md). Chunk files are sent by the web server straight from disk
(`local_path`), so chunk GETs never copy bytes through Python.

Chunk uploads are group-committed (`server.groupcommit`): `stage` writes and fsyncs the temporary file
(in the request's own thread, so the uploads of a batch sync their bytes in parallel), and `publish`
renames a whole batch into place and then fsyncs each directory it renamed into: the first of those
commits the file system's journal with every rename of the batch in it, so the others find little left
to do. Not `syncfs()`: that flushes every dirty file of the file system, and with another program writing
a lot to it (1.5 GB being written here) one took 440 ms where a file and directory fsync took 1.3 ms.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from parcels.durable import fsync_path

from ..errors import NotFound, StorageError
from .base import ObjectInfo, ObjectStore, Staged, Upload


class DirectoryStore(ObjectStore):
    """Objects as files under `root`."""

    kind = "directory"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        try:
            for sub in ("chunks", "parcels", "staging", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create the store directory {self.root}: {e.strerror}") from None

    def _path(self, key: str) -> Path:
        return self.root / key

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        upload = self.new_upload()
        try:
            upload.write(data)
            upload.commit(key)
        except BaseException:
            upload.abort()
            raise

    def new_upload(self) -> Upload:
        return _FileUpload(self)

    def stage(self, key: str, data: bytes) -> Staged | None:
        upload = _FileUpload(self)
        upload.write(data)
        upload.close(sync=True)
        return Staged(key, Path(upload.name))

    def publish(self, staged: Sequence[Staged]) -> None:
        done = 0
        try:
            dirs: dict[Path, None] = {}
            for item in staged:
                target = self._path(item.key)
                _rename_into(item.path, target)
                dirs[target.parent] = None
                done += 1
            for directory in dirs:
                fsync_path(directory)
        except OSError as e:
            for item in staged[done:]:
                with contextlib.suppress(OSError):
                    os.unlink(item.path)
            raise StorageError(f"cannot store {len(staged)} objects: {e.strerror}") from None

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no object {key}") from None
        except OSError as e:
            raise StorageError(f"cannot read {key}: {e.strerror}") from None

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"cannot stat {key}: {e.strerror}") from None

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot delete {key}: {e.strerror}") from None

    def delete_prefix(self, prefix: str) -> int:
        path = self._path(prefix.rstrip("/"))
        if not path.exists():
            return 0
        count = sum(1 for _ in self.list(prefix))
        # Rename first so a half-deleted tree is never visible under its real name.
        doomed = self.tmp / f"deleting.{os.getpid()}.{os.urandom(6).hex()}"
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except FileNotFoundError:
            return 0
        except OSError as e:
            raise StorageError(f"cannot delete {prefix}: {e.strerror}") from None
        return count

    def copy(self, src: str, dst: str) -> None:
        source, target = self._path(src), self._path(dst)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.tmp / f"link.{os.getpid()}.{os.urandom(6).hex()}"
            # Objects are never modified in place, so a hard link is a safe copy.
            os.link(source, tmp)
            os.rename(tmp, target)
            fsync_path(target.parent)
        except FileNotFoundError:
            raise NotFound(f"no object {src}") from None
        except OSError as e:
            raise StorageError(f"cannot copy {src} to {dst}: {e.strerror}") from None

    def move_prefix(self, src: str, dst: str) -> None:
        source, target = self._path(src.rstrip("/")), self._path(dst.rstrip("/"))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not source.exists():
                source.mkdir(parents=True)
            if target.exists():
                shutil.rmtree(target)
            os.rename(source, target)
            fsync_path(target.parent)
        except OSError as e:
            raise StorageError(f"cannot move {src} to {dst}: {e.strerror}") from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                yield ObjectInfo(os.path.relpath(full, self.root).replace(os.sep, "/"), st.st_size, st.st_mtime)


class _FileUpload(Upload):
    """A temporary file under ROOT/tmp, renamed into place on commit."""

    def __init__(self, store: DirectoryStore) -> None:
        self.store = store
        self.size = 0
        try:
            fd, name = tempfile.mkstemp(dir=store.tmp, prefix="upload.")
        except OSError as e:
            raise StorageError(f"cannot create a temporary file in {store.tmp}: {e.strerror}") from None
        self.file = os.fdopen(fd, "wb")
        self.name = name

    def write(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            self.abort()
            raise StorageError(f"cannot write {self.name}: {e.strerror}") from None
        self.size += len(data)

    def close(self, *, sync: bool) -> None:
        """Close the temporary file (after an fsync with ``sync``)."""
        try:
            self.file.flush()
            if sync:
                os.fsync(self.file.fileno())
            self.file.close()
        except OSError as e:
            self.abort()
            raise StorageError(f"cannot write {self.name}: {e.strerror}") from None

    def commit(self, key: str) -> None:
        target = self.store._path(key)
        self.close(sync=True)
        try:
            _rename_into(Path(self.name), target)
            fsync_path(target.parent)
        except OSError as e:
            self.abort()
            raise StorageError(f"cannot store {key}: {e.strerror}") from None

    def abort(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass
        try:
            os.unlink(self.name)
        except FileNotFoundError:
            pass


def _rename_into(source: Path, target: Path) -> None:
    """Rename a temporary file to its object's name, making the directories on the way."""
    try:
        os.rename(source, target)
    except FileNotFoundError:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, target)
