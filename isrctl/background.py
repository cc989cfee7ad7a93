"""A transfer that runs beside another one: a daemon thread with a Future for its result.

Used where two transfers share the link so that neither waits for the other (the boot files beside vulpes's
hoard, a checkin's blobs beside vulpes's chunk upload). Unlike a `concurrent.futures` pool, nothing waits
for the thread if the caller gives up (an error, Ctrl-C): the process may exit with it still running, so
what it writes must be safe to cut short (files are written whole or not at all; blobs staged at the server
count only once a commit names them).
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def start(name: str, work: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """Run ``work(*args)`` on a daemon thread called ``name``; its result or exception is in the Future."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # handed to whoever asks for the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
