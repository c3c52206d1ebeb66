"""Child processes of `llm-runner up` (services/orchestrator/launcher.py starts them with
LAUNCHED_ENV set): a terminal's Ctrl-C reaches the whole process group, and the parent
alone answers it, with one "interrupted" line and a SIGTERM to each child."""

from __future__ import annotations

import os
import signal

LAUNCHED_ENV = "LLM_RUNNER_LAUNCHED"


def is_launched() -> bool:
    return bool(os.environ.get(LAUNCHED_ENV))


def leave_interrupts_to_parent() -> None:
    """In a launched child, ignore SIGINT until its server handles the signal itself
    (`serve_until_signal` and the gateway's server take it back once they serve). Called
    first thing, before the heavy imports: a KeyboardInterrupt raised inside one (numpy's
    C extensions, say) comes out as an ImportError that blames the install. The parent
    stops a child that is still starting with SIGTERM."""
    if is_launched():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
