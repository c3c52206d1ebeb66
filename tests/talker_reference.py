"""The reference talker's codec in numpy (clients/cpp/talker/codec.h), its binary, and the
binary started as a process.

    u(k)    = ((splitmix64(0x7A1CE5 + (k + 1) * 0x9E3779B97F4A7C15) >> 11) * 2^-53) * 2 - 1
    P[i][j] = float32(u(i * 2048 + j))                               [hidden, 2048]
    frame   = argmax_j sum_i float64(h[i]) * float64(P[i][j])        first maximum wins
"""

from __future__ import annotations

import functools
import re
import subprocess
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CPP = ROOT / "clients" / "cpp"
BUILD = CPP / "build"
NUM_CODES = 2048
SEED = 0x7A1CE5
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_build_lock = threading.Lock()


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def projection(hidden: int) -> np.ndarray:
    """The talker's [hidden, 2048] float32 projection."""
    k = np.arange(hidden * NUM_CODES, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = splitmix64(np.uint64(SEED) + (k + np.uint64(1)) * _GOLDEN)
    u = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53 * 2.0 - 1.0
    p = u.astype(np.float32).reshape(hidden, NUM_CODES)
    p.flags.writeable = False
    return p


def codec_frame(states_last_row: np.ndarray) -> int:
    """The frame code of one hidden state: the same float64 sums, in the same order, as C++."""
    h = np.asarray(states_last_row, dtype=np.float32).reshape(-1).astype(np.float64)
    p = projection(h.shape[0])
    scores = np.zeros(NUM_CODES, dtype=np.float64)
    for i in range(h.shape[0]):
        scores += h[i] * p[i].astype(np.float64)
    return int(np.argmax(scores))


def talker_binary() -> Path:
    """clients/cpp/build/talker_stage, configured and built with cmake if it is missing."""
    binary = BUILD / "talker_stage"
    with _build_lock:
        if not binary.exists():
            subprocess.run(["cmake", "-S", str(CPP), "-B", str(BUILD),
                            "-DCMAKE_BUILD_TYPE=Release"], check=True, stdout=subprocess.DEVNULL)
            subprocess.run(["cmake", "--build", str(BUILD), "-j2"], check=True,
                           stdout=subprocess.DEVNULL)
    return binary


def start_talker(port: int = 0, *args: str) -> tuple[subprocess.Popen, str]:
    """The talker as a process on `port` (0: picked by the OS), with more command-line `args`:
    (process, "127.0.0.1:port")."""
    proc = subprocess.Popen([str(talker_binary()), "--port", str(port), "--stage-id", "talker",
                             *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.fullmatch(r"talker: listening on (127\.0\.0\.1:\d+)\n", line)
    assert match, f"talker did not start: {line!r}"
    return proc, match.group(1)
