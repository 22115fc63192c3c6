"""Whether an iteration boundary saves: the same verdict on every rank.

``SaveTrigger`` gathers what asks for a save (the loop's ``request_save``, a signal, requests
from outside polled by rank 0 from the control area), lets every rank learn every flag with
one small all-reduce, and asks the save policy. Requests travel only when there are some,
and are answered on rank 0 once the save committed or failed.
"""

from __future__ import annotations

from collections.abc import Callable

from .comm import Comm
from .control import ControlArea, SaveRequest, SignalFlag, poll_everywhere
from .policy import Decision, DecisionContext

__all__ = ["SaveTrigger"]


class SaveTrigger:
    """One loop's save triggers. Every rank makes every call (``decide`` is collective)."""

    def __init__(self, comm: Comm, control: ControlArea, policy: Callable[[DecisionContext], Decision], *,
                 handle_signals: bool) -> None:
        self.comm = comm
        self.control = control
        self.policy = policy
        self.signals = SignalFlag()
        self.save_requested = self.stop_requested = False
        if handle_signals:
            self.signals.install()

    def request(self, *, stop: bool = False) -> None:
        """Save at the next boundary (and stop afterwards when ``stop``)."""
        self.save_requested = True
        self.stop_requested = self.stop_requested or stop

    def decide(self, iteration: int) -> tuple[Decision, list[SaveRequest]]:
        """Collective: the policy's decision at this boundary and the outside requests it answers."""
        requests, (wants_save, wants_stop) = poll_everywhere(self.control, self.comm, [
            self.save_requested, self.stop_requested or self.signals.signum is not None])
        decision = self.policy(DecisionContext(iteration, requested=bool(wants_save), stop=bool(wants_stop),
                                               requests=tuple(requests)))
        self.save_requested = False
        return decision, requests

    def answer(self, requests: list[SaveRequest], *, step: int | None, error: str | None = None) -> None:
        """Rank 0 tells the askers the outcome (the step committed, or the error)."""
        if self.comm.rank == 0:
            self.control.answer(requests, step=step, error=error)

    def close(self) -> None:
        """The signal handlers as they were before."""
        self.signals.uninstall()
