"""The one asynchronous save in flight: a named object holding a ``Future``.

The loop stages the state (a memory copy) and goes on; a thread of its own writes
the shards, gathers the records on a process group of its own and commits. The
next save, a requested save and ``close()`` wait for it, and its error is raised
there, on every rank.

``Prepared``: something made ahead of its first use by a thread of its own (the host
buffers of the first asynchronous save's copy), handed over whole or in part.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .errors import SaveFailedError

__all__ = ["BackgroundSave", "Prepared"]

T = TypeVar("T")


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


class Prepared(Generic[T]):
    """``make(stop)`` running in a daemon thread of its own, from ``start`` until ``take()``.

    ``make`` checks ``stop`` between pieces of its work and returns what it made so far once it
    is set. Only ``take()`` hands the result over, after the thread ended: nothing made here is
    ever seen while it is still being written. A daemon: a process that never takes it does not
    wait for it at exit.
    """

    def __init__(self, make: Callable[[threading.Event], T], name: str) -> None:
        self._stop = threading.Event()
        self._made: T | None = None
        self._thread = threading.Thread(target=self._run, args=(make,), name=name, daemon=True)

    @classmethod
    def start(cls, make: Callable[[threading.Event], T], *, name: str) -> Prepared[T]:
        prepared = cls(make, name)
        prepared._thread.start()
        return prepared

    def _run(self, make: Callable[[threading.Event], T]) -> None:
        try:
            self._made = make(self._stop)
        except Exception:  # noqa: BLE001 - an optimisation: the user of it makes its own, and fails there
            self._made = None

    def take(self) -> T | None:
        """Stop the work, wait for the thread; what it made (None if it failed). Once."""
        self._stop.set()
        self._thread.join()
        made, self._made = self._made, None
        return made
