"""`llm-runner` command line: `generate` streams text for one prompt; `serve` runs the stage
as a gRPC service; `up` starts a local deployment (stage processes + orchestrator);
`build-engine` builds a TensorRT-RTX plan."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llm_runner_svc.engines import create_engine, engine_names
from llm_runner_svc.errors import InvalidArgument, RunnerError
from llm_runner_svc.export.build_cli import add_build_engine, run_build_engine
from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve
from llm_runner_svc.up_cli import add_up, run_up


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--model", default=None,
                   help="llama2.c .bin, .gguf file or Hugging Face directory "
                        "(default: the embedded stories260K)")
    p.add_argument("--engine", default="numpy", choices=engine_names())
    p.add_argument("--device", default=None,
                   help="torch engine only: cpu, cuda or cuda:N (default: a GPU if there is one)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--max-seq", type=int, default=0, help="positions per request (0 = model's)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _generate(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    if args.chat:
        if model.chat_template is None:
            raise InvalidArgument(f"model {model.name} has no chat template; drop --chat")
        text = model.chat_template.render([{"role": "user", "content": args.prompt}])
        ids = model.tokenizer.encode(text, add_bos=False)
    else:
        ids = model.tokenizer.encode(args.prompt, add_bos=model.tokenizer.default_add_bos())
    options = {} if args.device is None else {"device": args.device}
    if options and args.engine != "torch":
        raise InvalidArgument(f"--device needs --engine torch (got --engine {args.engine})")
    engine = create_engine(args.engine, model.config, model.weights, **options)
    runtime = InferenceRuntime(engine, model.tokenizer,
                               RuntimeConfig(max_batch=1, max_seq=args.max_seq))
    runtime.preallocate()
    sampling = resolve(runtime.config.sampling, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, max_new_tokens=args.max_tokens, seed=args.seed)
    request = GenerationRequest("cli", ids, sampling, stop=tuple(args.stop))
    if not args.chat:
        sys.stdout.write(args.prompt)
    try:
        for ev in runtime.generate(request):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finish_reason is not None:
                sys.stdout.write("\n")
                m = ev.metrics.as_dict() if ev.metrics else {}
                stats = " ".join(f"{k}={v}" for k, v in m.items())
                print(f"[{ev.finish_reason.value}] {stats}", file=sys.stderr)
                if ev.error:
                    print(f"error: {ev.error}", file=sys.stderr)
                    return 1
    finally:
        runtime.close()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the LlmRunner stage over gRPC")
    p.add_argument("--config", default=None,
                   help="stage deployment file (multistage_config.json style); default: the "
                        "embedded stories260K model")
    p.add_argument("--stage", default=None, help="stage id in --config (when it holds several)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="port to bind (0 = any free port)")
    p.add_argument("--max-message-mb", type=float, default=16.0,
                   help="largest gRPC message accepted or sent, MiB")
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="on SIGTERM, how long running requests may take before being cancelled")
    p.add_argument("--slot-ttl-s", type=float, default=600.0,
                   help="drop slots nobody touched for this long")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0 = any free; default off)")


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
    serve(config, options, args.slot_ttl_s, args.metrics_port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-runner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    add_up(sub)
    add_build_engine(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "up":
            return run_up(args)
        if args.command == "build-engine":
            return run_build_engine(args)
    except RunnerError as exc:
        print(f"llm-runner: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
