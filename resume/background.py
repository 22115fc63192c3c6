"""The one asynchronous save in flight: a named object holding a ``Future``.

The loop stages the state (a memory copy) and goes on; a thread of its own writes
the shards, gathers the records on a process group of its own and commits. The
next save, a requested save and ``close()`` wait for it, and its error is raised
there, on every rank.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from .errors import SaveFailedError

__all__ = ["BackgroundSave"]


class BackgroundSave:
    """The write and commit of ``step``, running in a thread of its own."""

    def __init__(self, step: int, url: str) -> None:
        self.step = step
        self.url = url
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, step: int, url: str, work: Callable[[], None], *,
              on_failure: Callable[[], None]) -> BackgroundSave:
        """Run ``work`` in the background; ``on_failure`` cleans up after it fails (before the
        error is handed to the waiter)."""
        save = cls(step, url)

        def run() -> None:
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - raised by the next wait, on this rank
                on_failure()
                save.future.set_exception(e if isinstance(e, Exception) else SaveFailedError(
                    f"{url}: background write interrupted: {e!r}"))
            else:
                save.future.set_result(None)
        # Not a daemon: a script that ends without close() still finishes the write.
        save._thread = threading.Thread(target=run, name=f"resume-save-{step}")
        save._thread.start()
        return save

    def join(self) -> None:
        """Until the write and commit ended (an interrupted join can join again)."""
        if self._thread is not None:
            self._thread.join()

    def result(self) -> None:
        """After ``join()``: nothing when it committed, else its error raised here."""
        self.future.result(timeout=0)
