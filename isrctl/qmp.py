"""The one module that uses the ``qemu.qmp`` package: a synchronous QMP connection for `isrctl.qemu`.

The asynchronous client runs on a private event loop in a background thread, so callers (the `VM`
class, tests, code with an asyncio loop of its own) see plain blocking calls with timeouts.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from qemu.qmp import ConnectError, ExecuteError, QMPClient, QMPError

from .errors import QMPCommandError, VMError, VMTimeoutError

_T = TypeVar("_T")


class QMPConnection:
    """A synchronous face on ``qemu.qmp.QMPClient``: the client lives on a private loop in its own thread."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"qmp-{name}", daemon=True)
        self._thread.start()
        self._client: QMPClient = self._call(self._make_client(name), timeout=10)

    @staticmethod
    async def _make_client(name: str) -> QMPClient:
        # Built inside the loop so that any asyncio objects it creates belong to that loop.
        return QMPClient(name)

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float | None) -> _T:
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)
        try:
            return future.result()
        except TimeoutError as exc:  # also asyncio's (an alias since Python 3.11)
            raise VMTimeoutError(f"QMP did not answer within {timeout} s") from exc

    def connect(self, path: Path, timeout: float) -> None:
        """Connect to QEMU's monitor socket; raises `VMError` (`VMTimeoutError` on a timeout)."""
        try:
            self._call(self._client.connect(str(path)), timeout)
        except ConnectError as exc:
            raise VMError(f"cannot connect to QEMU's monitor at {path}: {exc}") from exc

    def execute(self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        try:
            return self._call(self._client.execute(command, arguments), timeout)
        except ExecuteError as exc:
            raise QMPCommandError(command, exc.error_class, str(exc)) from exc
        except (QMPError, EOFError, OSError) as exc:
            raise VMError(f"QMP command {command} failed: {exc!r}") from exc

    def send_fd(self, fd: int, name: str, timeout: float = 10.0) -> None:
        """Hand ``fd`` to QEMU (SCM_RIGHTS) and register it as ``name`` for ``fd:`` URIs (QMP ``getfd``)."""
        async def send() -> None:
            # On the loop's thread: the client's socket belongs to it, and getfd must be the very next
            # command after the descriptor, so nothing may interleave.
            self._client.send_fd_scm(fd)
            await self._client.execute("getfd", {"fdname": name})
        try:
            self._call(send(), timeout)
        except ExecuteError as exc:
            raise QMPCommandError("getfd", exc.error_class, str(exc)) from exc
        except (QMPError, EOFError, OSError) as exc:
            raise VMError(f"passing a file descriptor to QEMU failed: {exc!r}") from exc

    def shutdown_reason(self) -> str | None:
        """The reason of the last ``SHUTDOWN`` event QEMU sent (``guest-shutdown``, ``guest-reset``, ``host-qmp-quit``,
        ...), or None if it sent none."""
        for event in reversed(self._client.events.history):
            if event.get("event") == "SHUTDOWN":
                data = event.get("data")
                reason = data.get("reason", "") if isinstance(data, dict) else ""
                return str(reason) or None
        return None

    def close(self) -> None:
        try:
            self._call(self._client.disconnect(), timeout=5)
        except (QMPError, EOFError, OSError, VMError):
            # After 'quit' QEMU hangs up first; disconnect() then reports the EOF. Nothing to do about it.
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
