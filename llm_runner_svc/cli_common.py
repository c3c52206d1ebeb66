"""What every `llm-runner` subcommand shares: help with defaults, `--version`, the exit codes
and one-line messages of expected failures, gRPC's own log kept quiet, and the model-load
progress bar.

This module imports no tensor library, and neither do the command modules at import time:
a Ctrl-C while they load (numpy and the rest take a moment) lands inside `run_command`.

Exit codes: 0 done, 1 the generation ended in error, 2 an expected failure (a message naming
the problem and the fix), 130 interrupted by Ctrl-C, 141 (silently) stdout's reader went away.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import llm_runner_svc
from llm_runner_svc.errors import RunnerError, Unavailable
from services.launched import is_launched

EXIT_FAILED = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader left (`| head`), as coreutils report

# The modules each engine needs beyond this package (`--version` lists the importable ones).
_ENGINE_NEEDS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",), "onnx": ("onnxruntime",), "onnx-fp16": ("onnxruntime",),
    "tensorrt": ("tensorrt_rtx|tensorrt",), "torch": ("torch",), "synthetic": (),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help, except where the default means "not given"
    (None, False, an empty list) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        is_unset = action.default is None or action.default is False or action.default in ([], "")
        if is_unset or "default" in text:
            return text
        return super()._get_help_string(action)


def quiet_grpc() -> None:
    """gRPC core logs nothing unless GRPC_VERBOSITY asks for it; must run before grpc is
    imported (core reads the variable once). Children started later inherit it."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def _has_module(names: str) -> bool:
    return any(importlib.util.find_spec(n) is not None for n in names.split("|"))


def version_text(prog: str) -> str:
    """The package version, the contract version and the engines this install can run."""
    from llm_runner_svc.stage.describe import CONTRACT_VERSION

    usable = [e for e, needs in _ENGINE_NEEDS.items() if all(map(_has_module, needs))]
    return (f"{prog} {llm_runner_svc.__version__} (contract {CONTRACT_VERSION}; "
            f"engines: {', '.join(usable)})")


def add_version(parser: argparse.ArgumentParser, prog: str) -> None:
    """`--version`; the text is built only when asked for (it looks for engine libraries)."""

    class _Version(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
            print(version_text(prog))
            parser.exit()

    parser.add_argument("--version", action=_Version, nargs=0, default=argparse.SUPPRESS,
                        help="print the package and contract versions and the usable engines")


def bind_failure(host: str, port: int, flag: str = "--port") -> RunnerError:
    """The one-line error for a server that could not bind (gRPC raises RuntimeError)."""
    if port == 0:  # any free port would do: the address is the problem
        return Unavailable(f"cannot listen on {host}: not an address of this machine; use "
                           f"--host 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    return Unavailable(f"cannot listen on {host}:{port} (in use, or not an address of this "
                       f"machine): stop what listens there, or pick another port with "
                       f"{flag} (0 = any free port)")


def is_bind_failure(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError | OSError) and "bind" in str(exc).lower()


def run_command(prog: str, command: Callable[[], int]) -> int:
    """Runs one subcommand; expected failures and Ctrl-C become one line on stderr."""
    try:
        return command()
    except RunnerError as exc:
        print(f"{prog}: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if is_launched():  # a stage child of `up`: the parent says it once
            return EXIT_INTERRUPTED
        # On a terminal the line starts after the echoed ^C and any partial text or bar.
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Later writes (the interpreter's last flush included) go nowhere instead of failing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


class _TqdmWatcher:
    """Shows a load as a bytes bar on stderr (tqdm), one bar per loader. A ticker thread
    redraws it twice a second, so the elapsed time runs even while a loader parses metadata
    without reading tensors."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None

    def start(self, total_bytes: int, what: str) -> None:
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=total_bytes, desc=f"loading {what}", unit="B", unit_scale=True,
                         unit_divisor=1024, leave=False, file=sys.stderr)
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, args=(self._bar, self._stopped),
                                        name="load-progress", daemon=True)
        self._ticker.start()

    @staticmethod
    def _tick(bar: Any, stopped: threading.Event) -> None:
        while not stopped.wait(0.5):
            bar.refresh()  # tqdm serialises drawing with its own lock

    def advance(self, num_bytes: int) -> None:
        if self._bar is not None:
            self._bar.update(num_bytes)

    def close(self) -> None:
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` in binary units, as a person reads them: 512 B, 1.5 KiB, 270.6 MiB."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    size = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class _LineWatcher:
    """Where no bar can be drawn (stderr a log file or pipe, or no tqdm): one line per loader
    as it starts, so a load of several seconds is not a silent wait."""

    def start(self, total_bytes: int, what: str) -> None:
        print(f"loading {what} ({format_bytes(total_bytes)}) ...", file=sys.stderr, flush=True)

    def advance(self, num_bytes: int) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def load_progress(is_quiet: bool) -> Iterator[None]:
    """Shows the model loads inside the block unless `is_quiet`: a bar where stderr is a
    terminal and tqdm is installed (it is optional), else a line per load as it starts."""
    if is_quiet:
        yield
        return
    from llm_runner_svc.models.progress import watching

    can_draw = sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None
    watcher: _TqdmWatcher | _LineWatcher = _TqdmWatcher() if can_draw else _LineWatcher()
    try:
        with watching(watcher):
            yield
    finally:
        watcher.close()
