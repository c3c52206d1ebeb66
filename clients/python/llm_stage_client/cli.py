"""`llm-stage` command line: `generate` streams one generation from an orchestrator to stdout;
`up` is an alias of the server package's `llm-runner up` (a whole local deployment), for an
install that has it. Nothing here imports the servers."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from llm_stage_client.client import DEFAULT_TARGET, Client
from llm_stage_client.types import Delta, FinalReport, StageClientError

# A subcommand is a pair: a function adding its parser to the subparsers, and the function
# running it (returning the exit code). Subcommands from other modules join `_COMMANDS`.
AddFn = Callable[[argparse._SubParsersAction], object]
RunFn = Callable[[argparse.Namespace], int]

TARGET_ENV = "LLM_STAGE_TARGET"
# Finish reasons that mean the request did not complete; the command exits 1 for them.
_FAILED = ("error", "cancelled")


def default_target() -> str:
    """$LLM_STAGE_TARGET, else 127.0.0.1:50050."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one generation to stdout (report on stderr)")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--target", default=None,
                   help=f"orchestrator host:port (default: ${TARGET_ENV} or {DEFAULT_TARGET})")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of the whole request, seconds (default: none)")
    p.add_argument("--request-id", default="", help="request id (default: the orchestrator's)")


def _generate(args: argparse.Namespace) -> int:
    with Client(args.target or default_target(), timeout=args.timeout) as client:
        try:
            items = client.generate(args.prompt, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                    max_tokens=args.max_tokens, stop=args.stop,
                                    request_id=args.request_id)
        except ValueError as exc:
            # Values argparse lets through but a field cannot hold (a negative seed).
            raise StageClientError("INVALID_ARGUMENT", str(exc)) from exc
        report = _stream_text(items)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if report is None:
        raise StageClientError("UNKNOWN", "the Generate stream ended without a final report")
    print(json.dumps(dataclasses.asdict(report)), file=sys.stderr)
    return 1 if report.finish_reason in _FAILED else 0


def _stream_text(items: Iterator[Delta | FinalReport]) -> FinalReport | None:
    """Writes the text of the deltas to stdout as they come; returns the final report."""
    shown: tuple[str, str] | None = None
    report = None
    try:
        for item in items:
            if isinstance(item, FinalReport):
                report = item
                continue
            # Text and token ports of a stage both carry the text, and the default sinks may
            # name several; the first sink that speaks is the one shown, so no text is doubled.
            shown = shown or (item.stage_id, item.port)
            if (item.stage_id, item.port) == shown:
                sys.stdout.write(item.text)
                sys.stdout.flush()
    except StageClientError:
        if shown is not None:
            sys.stdout.write("\n")  # end the partial text before the error line on stderr
            sys.stdout.flush()
        raise
    return report


# The server side: its import name, and the distribution that brings it.
SERVER_PACKAGE = "llm_runner_svc"
SERVER_DISTRIBUTION = "llm-runner-svc"


def _add_up(sub: argparse._SubParsersAction) -> None:
    # Every argument goes to `llm-runner up` as it is (its own --help included): a prefix no
    # argument starts with keeps this parser from reading any of them as its options.
    p = sub.add_parser("up", add_help=False, prefix_chars="\0",
                       help=f"start a local deployment: runs `llm-runner up` (needs the server "
                            f"package, pip install {SERVER_DISTRIBUTION})")
    p.add_argument("forward", nargs=argparse.REMAINDER)


def _up(args: argparse.Namespace) -> int:
    """Replaces this process with `llm-runner up` (so Ctrl-C and SIGTERM reach the deployment
    itself); fails without a traceback when the server package is not installed."""
    if importlib.util.find_spec(SERVER_PACKAGE) is None:
        raise StageClientError(
            "FAILED_PRECONDITION", f"`llm-stage up` starts the servers, which this install "
            f"does not have (only the client library is installed); install them with "
            f"`pip install {SERVER_DISTRIBUTION}`, then run `llm-runner up`")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", SERVER_PACKAGE, "up", *args.forward])
    return 0  # not reached: execv returns only by raising


_COMMANDS: list[tuple[AddFn, RunFn]] = [(_add_generate, _generate), (_add_up, _up)]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand in `_COMMANDS`; each one's `run` is in `args.run`."""
    parser = argparse.ArgumentParser(prog="llm-stage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add, run in _COMMANDS:
        known = set(sub.choices)
        add(sub)
        # Add functions only get `sub` (so ones from other modules fit as they are): the names
        # they added are theirs, and each runs `run`.
        for name in set(sub.choices) - known:
            sub.choices[name].set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `llm-stage`; the exit code: 0 done, 1 the request ended in error or was cancelled,
    2 the call failed."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.run(args)
    except StageClientError as exc:
        print(f"llm-stage: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
