"""The directory object store: the parcel store layout on a local file system.

Every object is written as a temporary file under ``ROOT/tmp``, fsynced, renamed into place, and its
directory fsynced (doc/parcel-format.md). Chunk files are sent by the web server straight from disk
(`local_path`), so chunk GETs never copy bytes through Python.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import NotFound, StorageError
from .base import ObjectInfo, ObjectStore, Upload


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
            _fsync_dir(target.parent)
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
            _fsync_dir(target.parent)
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

    def commit(self, key: str) -> None:
        target = self.store._path(key)
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            try:
                os.rename(self.name, target)
            except FileNotFoundError:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(self.name, target)
            _fsync_dir(target.parent)
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
