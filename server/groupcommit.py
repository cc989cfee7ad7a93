"""Group commit for chunk uploads: concurrent chunk PUTs share one durability point.

Each chunk PUT used to make its object durable on its own (an fsync of the file and one of its directory)
and then record it in the chunk index in a transaction of its own. Now a request writes its object
(`ObjectStore.stage`: the directory store fsyncs the temporary file, not yet its name) and queues it here;
one commit at a time runs per worker process, and whatever queued up meanwhile forms the next batch (no
timer: an upload that finds nobody committing is committed at once). A batch is one `ObjectStore.publish`
(directory store: the renames, then an fsync of each directory, of which the first commits the journal
with all the renames; S3: nothing, its PUTs are durable when they return) followed by one metadata
transaction (`MetaStore.chunks_add`, sqlite or PostgreSQL). A request is answered only after its batch
committed, so an acknowledged upload is as durable as before, and the order is as before: the object is
durable under its name before the index records it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .meta import MetaStore
from .store.base import ObjectStore, Staged

#: The most chunks in one batch (a batch larger than this is split; the rest go in the next one).
MAX_BATCH = 512


@dataclass(frozen=True)
class _Entry:
    tag: str
    size: int
    staged: Staged | None
    done: asyncio.Future[bool]


class ChunkCommitter:
    """The group committer of one worker process. `run` runs blocking work in the worker's thread pool."""

    def __init__(self, run: Callable[..., Awaitable[Any]], store: ObjectStore, meta: MetaStore) -> None:
        self.run = run
        self.store = store
        self.meta = meta
        self._queue: list[_Entry] = []
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.chunks = 0

    async def add(self, tag: str, size: int, staged: Staged | None) -> bool:
        """Commit one uploaded chunk (its `ObjectStore.stage` result, or None if the object was stored
        already) together with whatever else is waiting. True once it is durable and recorded; False if gc
        is deleting the chunk right now (as `MetaStore.chunk_add`). Raises the batch's StorageError."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append(_Entry(tag, size, staged, done))
        if self._task is None:
            # A task of its own, so that no request's fate (cancelled, failed) stops the commits of others.
            self._task = asyncio.ensure_future(self._drain())
        return await done

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                try:
                    refused = await self.run(self._commit, batch)
                except Exception as e:  # noqa: BLE001 - every waiter gets the batch's failure
                    for entry in batch:
                        if not entry.done.done():
                            entry.done.set_exception(e)
                    continue
                self.batches += 1
                self.chunks += len(batch)
                for entry in batch:
                    if not entry.done.done():
                        entry.done.set_result(entry.tag not in refused)
        finally:
            self._task = None

    def _commit(self, batch: Sequence[_Entry]) -> set[str]:
        """One durability point for the batch's objects, then one index transaction."""
        self.store.publish([e.staged for e in batch if e.staged is not None])
        return self.meta.chunks_add([(e.tag, e.size) for e in batch])
