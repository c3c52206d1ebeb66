"""The decode thread: the one thread that calls `runtime.step()` and `runtime.apply_cancels()`.

It steps on by itself for as long as its permission allows and hands every result (a step's
events, or the exception a step raised) to `post` without waiting for it to be handled. The
permission comes from the event loop thread (`permit`) as two absolute limits on the number of
jobs (steps and cancel applications) started since the thread began:
  - `step_limit`: a step may start while fewer jobs than this have started (the cap on jobs
    not yet handled and the cohorts' credits, as `StepLoop` computes them);
  - `job_limit`: while the credits hold steps, `apply_cancels()` may still start below this,
    so a cancel lands while readers are out of credit.
After a step raises, the thread starts nothing until a `permit(..., resume=True)` (a wake).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from llm_runner_svc.runtime import InferenceRuntime, StepEvent

log = logging.getLogger(__name__)

Result = list[StepEvent] | Exception


class DecodeThread:
    """Runs the runtime's jobs on one thread within the limits the event loop grants."""

    def __init__(self, runtime: InferenceRuntime, post: Callable[[Result], object]) -> None:
        self.runtime = runtime
        self._post = post  # thread-safe; hands a result to the event loop in order
        self._cond = threading.Condition(threading.Lock())
        self._started = 0  # jobs started; only this thread writes it
        self._step_limit = 0
        self._job_limit = 0
        self._is_halted = False  # a step raised; nothing starts until the next resume
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def permit(self, step_limit: int, job_limit: int, resume: bool = False) -> None:
        """New limits (absolute job counts); `resume` lifts the halt after a failed step."""
        with self._cond:
            self._step_limit, self._job_limit = step_limit, job_limit
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

    def _next_job(self) -> Callable[[], list[StepEvent]] | None:
        """Wait until a job may start and return it; None once stopping."""
        rt = self.runtime
        with self._cond:
            while not self._is_stopping:
                job = None
                if self._is_halted:
                    pass
                elif self._started < self._step_limit and rt.has_work:
                    job = rt.step
                elif self._started < self._job_limit and rt.has_cancels:
                    job = rt.apply_cancels
                if job is not None:
                    self._started += 1
                    return job
                self._cond.wait()
        return None
