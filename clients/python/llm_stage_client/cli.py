"""`llm-stage` command line: `generate` streams one generation from an orchestrator to stdout;
`up` is an alias of the server package's `llm-runner up` (a whole local deployment), for an
install that has it; `adapters` lists, loads or unloads one stage's LoRA adapters. Nothing
here imports the servers."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence

from llm_stage_client._contract.llmstage.v1 import orchestrator_pb2
from llm_stage_client.admin import ADMIN_TOKEN_ENV, StageAdmin
from llm_stage_client.cli_controls import add_control_args, control_options
from llm_stage_client.cli_show import Display, report_json, stream
from llm_stage_client.client import DEFAULT_TARGET, Client
from llm_stage_client.types import GenerateOptions, StageClientError

# A subcommand is a pair: a function adding its parser to the subparsers, and the function
# running it (returning the exit code). Subcommands from other modules join `_COMMANDS`.
AddFn = Callable[[argparse._SubParsersAction], object]
RunFn = Callable[[argparse.Namespace], int]

TARGET_ENV = "LLM_STAGE_TARGET"
# Finish reasons that mean the request did not complete; the command exits 1 for them.
_FAILED = ("error", "cancelled")
EXIT_FAILED = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader left (`| head`), as coreutils report


def default_target() -> str:
    """$LLM_STAGE_TARGET, else 127.0.0.1:50050."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one generation to stdout (report on stderr)",
                       description="Streams the text to stdout; other sinks' deltas and the "
                                   "final report (JSON) go to stderr. Sampling values left out "
                                   "take the deployment's defaults.")
    # Every option's help states its default: this parser takes no default-adding formatter.
    p.add_argument("prompt", help="prompt text (the user's message with --chat)")
    p.add_argument("--target", default=None,
                   help=f"orchestrator host:port (default: ${TARGET_ENV} or {DEFAULT_TARGET})")
    p.add_argument("--sinks", default="",
                   help="stage:port names to stream, comma separated, e.g. "
                        "thinker:text,talker:audio (default: the topology's default sinks)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0 = greedy (default: the deployment's)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the K likeliest tokens, 0 = all (default: the "
                        "deployment's)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (default: the deployment's)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed, prompt and options give the same text "
                        "(default: a fresh random seed per request, in the report's "
                        "diagnostics as sampling.seed)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most new tokens (default: the deployment's)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop when this text appears (repeatable)")
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of the whole request, seconds (default: none)")
    p.add_argument("--request-id", default="", help="request id (default: the orchestrator's)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message of a conversation, which the "
                        "stage renders with its model's chat template (for chat models such "
                        "as SmolLM2-Instruct; default: the prompt as raw text)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before the user's (implies --chat; default: none)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="a PNG or JPEG image for a vision-language runner (repeatable); the "
                        "prompt then goes as one chat message: the images, then the text")
    p.add_argument("--adapter", default="",
                   help="LoRA adapter to run with, by the name the deployment's "
                        "lora_adapters gives it (default: the base model)")
    add_control_args(p)


def _generate(args: argparse.Namespace) -> int:
    target = args.target or default_target()
    sinks = [s.strip() for s in args.sinks.split(",") if s.strip()]
    display = Display()
    with Client(target, timeout=args.timeout) as client:
        try:
            options: GenerateOptions = dict(
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                request_id=args.request_id, sinks=sinks, adapter=args.adapter,
                **control_options(args))
            if args.chat or args.system is not None or args.image:
                options["messages"] = chat_messages(args.prompt, args.system, len(args.image))
                if args.image:
                    options["images"] = args.image
                items = client.generate(**options)
            else:
                items = client.generate(args.prompt, **options)
        except OSError as exc:
            raise StageClientError("INVALID_ARGUMENT", f"--image: {exc}") from exc
        except ValueError as exc:
            # Values argparse lets through but a field cannot hold (a negative seed).
            raise StageClientError("INVALID_ARGUMENT", str(exc)) from exc
        try:
            report = stream(items, display)
        except StageClientError as exc:
            raise with_hint(exc, target) from exc
    display.end_line()
    if report is None:
        raise StageClientError("UNKNOWN", "the Generate stream ended without a final report")
    print(report_json(report, display.scores()), file=sys.stderr)
    return 1 if report.finish_reason in _FAILED else 0


def chat_messages(prompt: str, system: str | None, num_images: int
                  ) -> list[tuple[str, str | Sequence[str | int]]]:
    """One user turn (its images first, then the text), after the system message if any."""
    user: str | list[str | int] = [*range(num_images), prompt] if num_images else prompt
    system_turn: list[tuple[str, str | Sequence[str | int]]] = \
        [("system", system)] if system is not None else []
    return [*system_turn, ("user", user)]


def with_hint(exc: StageClientError, target: str) -> StageClientError:
    """The error with what to do about it, for the failures a first run meets."""
    if exc.code == "UNAVAILABLE" and ("connect" in exc.message.lower()
                                      or "refused" in exc.message.lower()):
        return StageClientError(exc.code, f"nothing answers at {target}: start a deployment "
                                f"with `llm-stage up` (or `llm-runner up`), or point --target "
                                f"(or ${TARGET_ENV}) at a running orchestrator")
    if exc.code == "UNAVAILABLE" and "resolv" in exc.message.lower():
        return StageClientError(exc.code, f"cannot resolve the host of {target!r}: give "
                                f"--target (or ${TARGET_ENV}) as host:port")
    if exc.code == "UNIMPLEMENTED":
        return StageClientError(exc.code, f"{target} is not an orchestrator (no "
                                f"llmstage.v1.Orchestrator there; a stage from `llm-runner "
                                f"serve`?): point --target at the address `llm-runner up` "
                                f"prints as 'orchestrator listening on'")
    return exc


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
    # LLM_RUNNER_PROG: its usage and messages name this command, not `llm-runner`.
    os.execve(sys.executable, [sys.executable, "-m", SERVER_PACKAGE, "up", *args.forward],
              os.environ | {"LLM_RUNNER_PROG": "llm-stage"})
    return 0  # not reached: execv returns only by raising


def _add_adapters(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="list, load or unload a stage's LoRA adapters",
                       description="Talks to one stage (not the orchestrator). load and "
                                   "unload are admin calls: they send the stage's admin token "
                                   f"(--admin-token, default ${ADMIN_TOKEN_ENV}).")
    p.add_argument("action", choices=("list", "load", "unload"))
    p.add_argument("name", nargs="?", default="", help="the adapter's name (load, unload)")
    p.add_argument("path", nargs="?", default="",
                   help="load: the PEFT adapter directory, relative to the stage's artifact")
    p.add_argument("--stage", required=True, help="the stage's host:port")
    p.add_argument("--admin-token", default=None,
                   help=f"the stage's admin token (default: ${ADMIN_TOKEN_ENV})")


def _adapters(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.name or args.action == "load" and not args.path:
        print(f"llm-stage: adapters {args.action} needs "
              f"{'NAME PATH' if args.action == 'load' else 'NAME'}", file=sys.stderr)
        return EXIT_FAILED
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    with StageAdmin(args.stage, token) as admin:
        if args.action == "load":
            names = admin.load_adapter(args.name, args.path)
        elif args.action == "unload":
            names = admin.unload_adapter(args.name)
        else:
            names = admin.adapters()
    print("\n".join(names))
    return 0


_COMMANDS: list[tuple[AddFn, RunFn]] = [(_add_generate, _generate), (_add_up, _up),
                                         (_add_adapters, _adapters)]


def version_text() -> str:
    """The client's version and the contract it speaks."""
    version = "unknown"
    for dist in ("llm-stage-client", SERVER_DISTRIBUTION):  # alone, or inside the servers'
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return (f"llm-stage {version} (contract {orchestrator_pb2.DESCRIPTOR.package}; a client: "
            f"the engines are the deployment's, `llm-runner --version` lists them)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand in `_COMMANDS`; each one's `run` is in `args.run`."""
    parser = argparse.ArgumentParser(prog="llm-stage", description=__doc__)
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the client and contract versions")
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
    2 the call failed (one line on stderr says why and what to do), 130 Ctrl-C, 141 stdout's
    reader went away (`| head`)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.run(args)
    except StageClientError as exc:
        print(f"llm-stage: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # closing the client has cancelled the request on every stage
        print("llm-stage: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the request is cancelled as for Ctrl-C; no line: nobody reads
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
