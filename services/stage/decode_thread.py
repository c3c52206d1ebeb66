"""The decode thread: the one thread that calls the stepper's `step()` and `apply_cancels()`.

It steps on by itself for as long as its permission allows and hands every result (a step's
events, or the exception a step raised) to `post` without waiting for it to be handled. The
permission comes from the event loop thread (`permit`) as absolute counts of jobs (steps and
cancel applications) started since the thread began:
  - `job_limit`: a job may start while fewer than this have started (the cap on results not
    yet handled);
  - `run_limits`: a run may take part in a step only while fewer jobs than its limit have
    started (its readers' credits); a run at its limit is held for that step.
After a step raises, the thread starts nothing until a `permit(..., resume=True)` (a wake).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.stage.stepper import RunEvent, Stepper

log = logging.getLogger(__name__)

Result = Sequence[RunEvent] | Exception


class DecodeThread:
    """Runs the stepper's jobs on one thread within the limits the event loop grants."""

    def __init__(self, stepper: Stepper, post: Callable[[Result], object]) -> None:
        self.stepper = stepper
        self._post = post  # thread-safe; hands a result to the event loop in order
        self._cond = threading.Condition(threading.Lock())
        self._started = 0  # jobs started; only this thread writes it
        self._job_limit = 0
        self._run_limits: Mapping[str, int] = {}
        self._is_halted = False  # a step raised; nothing starts until the next resume
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def permit(self, job_limit: int, run_limits: Mapping[str, int],
               resume: bool = False) -> None:
        """New limits (absolute job counts); `resume` lifts the halt after a failed step."""
        with self._cond:
            self._job_limit, self._run_limits = job_limit, run_limits
            self._is_halted = self._is_halted and not resume
            self._cond.notify()

    def stop(self) -> None:
        """Start nothing more; the job in progress, if any, still ends and is posted."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            result: Result
            try:
                result = job()
            except Exception as exc:
                log.exception("decode step failed outside any request")
                with self._cond:
                    self._is_halted = True
                result = exc
            try:
                self._post(result)
            except RuntimeError:  # the event loop is closed: nobody is left to hand it to
                return

    def _next_job(self) -> Callable[[], Any] | None:
        """Wait until a job may start and return it; None once stopping."""
        st = self.stepper
        with self._cond:
            while not self._is_stopping:
                if not self._is_halted and self._started < self._job_limit:
                    held = frozenset(rid for rid, limit in self._run_limits.items()
                                     if self._started >= limit)
                    if st.can_step(held):
                        self._started += 1
                        return lambda: st.step(held)
                    if st.has_cancels:
                        self._started += 1
                        return st.apply_cancels
                self._cond.wait()
        return None
