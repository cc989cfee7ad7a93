"""What the API and the web pages work with, one `Service` per worker process: the configuration, the
metadata database and the object store, a thread pool for their blocking calls, and the operations both
doors share (breaking a lock, the audit log lines).

The service keeps no state of its own beyond connections (and the API's short-lived token cache), so any
number of workers and processes can serve: everything is in the database and the store.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .config import Config
from .groupcommit import ChunkCommitter
from .meta import LockInfo, MetaStore, open_meta
from .store import ObjectStore, open_store, staging_prefix

audit_log = logging.getLogger("server.audit")
T = TypeVar("T")


class Service:
    """The backends of one worker process, opened by `open` (at the ASGI lifespan's start-up)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="isr-io")
        self._meta: MetaStore | None = None
        self._store: ObjectStore | None = None
        self._chunk_commits: ChunkCommitter | None = None

    @property
    def meta(self) -> MetaStore:
        assert self._meta is not None, "the service is not open"
        return self._meta

    @property
    def store(self) -> ObjectStore:
        assert self._store is not None, "the service is not open"
        return self._store

    @property
    def chunk_commits(self) -> ChunkCommitter:
        assert self._chunk_commits is not None, "the service is not open"
        return self._chunk_commits

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking database or store work in the thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    async def open(self) -> None:
        store = await self.run(open_store, self.config)
        meta = await self.run(open_meta, self.config)
        self._chunk_commits = ChunkCommitter(self.run, store, meta)
        self._store, self._meta = store, meta

    def close(self) -> None:
        if self._meta is not None:
            self._meta.close()
        if self._store is not None:
            self._store.close()
        self.pool.shutdown(wait=False)

    def audit_line(self, remote: str, actor: str, action: str, parcel: str, **detail: Any) -> None:
        """One line of the audit log file (``server.audit_log``); the database's audit table is written
        by the metadata operations themselves."""
        audit_log.info("%s %s parcel=%s remote=%s %s", actor, action, parcel, remote,
                       json.dumps(detail, sort_keys=True))

    async def break_parcel_lock(self, remote: str, parcel: str, actor: str, reason: str,
                                expect_lock_id: str | None = None) -> LockInfo:
        """Break a parcel's lock and drop its staging area, audited. The API's break and the web page's
        release both come here, so either way the old holder's next commit is refused (``lock_lost``).
        The caller has checked that `actor` may do it."""
        old = await self.run(self.meta.break_lock, parcel, actor, remote, reason, expect_lock_id)
        await self.run(self.store.delete_prefix, staging_prefix(parcel, old.lock_id))
        self.audit_line(remote, actor, "lock.break", parcel, holder=old.to_json(), reason=reason)
        return old
