"""Running a test's Triton kernels on Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest


def rerun_interpreted(request: Any) -> bool:
    """Run the calling test again in a process that starts under Triton's CPU interpreter
    (chosen when kernels are first compiled, so it cannot be switched on here), unless this
    process is that one; True when it ran there (and passed)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          request.node.nodeid], env=env, capture_output=True, text=True,
                         cwd=request.config.rootpath, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "1 passed" in out.stdout
    return True
