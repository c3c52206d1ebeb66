"""Prefix reuse on the numpy engine: time to first token of a request whose long system
prompt is cached, against the first request that prefilled it.

Each request is a shared system prompt of --system tokens plus its own user turn of --user
tokens, generating one token. The first request fills the cache; the second reuses every
full page of the system prompt and prefills the rest. A third runs the second's prompt with
the lookup bypassed: the cost without reuse on a warm process. With --turns N, an N-turn
conversation (each turn repeats the previous prompt and answer and adds a user turn) counts
the prefilled positions with and without reuse.

With --engine torch --shape qwen2.5-7b (a CUDA GPU): the torch engine on random bf16
weights of that shape and random token ids, after one warm-up request.

Usage: python benchmarks/bench_prefix_cache.py [--model smollm2] [--system 2000] [--user 50]
                                               [--turns 8]
       python benchmarks/bench_prefix_cache.py --engine torch --shape qwen2.5-7b
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import Engine
from llm_runner_svc.models import Model, load_model
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    RequestMetrics,
    RuntimeConfig,
    SamplingParams,
)

TEXT = ("You are a careful assistant for a small library. Answer questions about opening hours, "
        "loans, renewals, fines, the reading room, events for children and the catalogue. ")


def tokens(model: Model, n: int, salt: str) -> list[int]:
    """`n` token ids of English text, different for each `salt` (random ids for a model
    with random weights)."""
    if model.format == "random":
        rng = random.Random(salt)
        return [rng.randrange(model.config.vocab_size) for _ in range(n)]
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        ids += model.tokenizer.encode(f"{salt} {k}. {TEXT}")
        k += 1
    return ids[:n]


def run(rt: InferenceRuntime, rid: str, prompt: list[int], max_new: int = 1,
        lookup: bool = True) -> tuple[RequestMetrics, list[int]]:
    req = GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, top_k=0, top_p=1.0,
                                                        max_new_tokens=max_new),
                            cache_lookup=lookup)
    out: list[int] = []
    for ev in rt.generate(req):
        out += ev.token_ids
        if ev.metrics is not None:
            return ev.metrics, out
    raise RuntimeError("no metrics")


Engines = Callable[[Model], Engine]


def numpy_engine(model: Model) -> Engine:
    return create_engine("numpy", model.config, model.weights)


def runtime(model: Model, engine: Engines, max_seq: int, reuse: bool) -> InferenceRuntime:
    rt = InferenceRuntime(engine(model), model.tokenizer,
                          RuntimeConfig(max_batch=1, max_seq=max_seq, prefix_cache=reuse))
    rt.preallocate()
    return rt


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _median(ms: list[RequestMetrics]) -> RequestMetrics:
    return sorted(ms, key=lambda m: m.ttft_ms)[len(ms) // 2]


def ttft(model: Model, engine: Engines, system: int, user: int, profile: bool = False,
         rounds: int = 1, gpu_profile: bool = False, timeline: bool = False,
         pause_ms: float = 0.0) -> None:
    """Each round: a new system prompt (cold), then the same system prompt with another
    user turn (reuse; `pause_ms` after the cold one ended, the device idle), then that
    prompt again with the lookup bypassed; the table gives each request's median round.
    With `timeline`, also where each round's reusing request spent its time (`_Marks`)."""
    rt = runtime(model, engine, system + user + 16, True)
    if model.format == "random":  # kernels compiled (a prefill after reused pages too)
        warm = tokens(model, system, "Warm-up")
        run(rt, "warm-up", warm + tokens(model, user, "Warm-up A"))
        run(rt, "warm-up reuse", warm + tokens(model, user, "Warm-up B"))
    seen: dict[str, list[RequestMetrics]] = {"first": [], "second": [], "bypass": []}
    splits: list[dict[str, float]] = []
    prof = cProfile.Profile() if profile else None
    for r in range(rounds):
        sys_ids = tokens(model, system, f"System {r}")
        seen["first"].append(run(rt, f"first {r}",
                                 sys_ids + tokens(model, user, f"Question A{r}"))[0])
        second = sys_ids + tokens(model, user, f"Question B{r}")
        if r == rounds - 1 and gpu_profile:
            _gpu_profile(rt, sys_ids + tokens(model, user, f"Question C{r}"))
        if r == rounds - 1 and timeline:
            _timeline(rt, [sys_ids + tokens(model, user, f"Question T{r}.{k}")
                           for k in range(9)])
        call = prof.runcall if prof is not None and r == rounds - 1 else _call
        time.sleep(pause_ms / 1e3)
        if timeline:
            with _Marks(rt.engine) as marks:
                metrics, split = marks.row(call, run, rt, f"second {r}", second)
            splits.append(split)
        else:
            metrics = call(run, rt, f"second {r}", second)[0]
        seen["second"].append(metrics)
        seen["bypass"].append(run(rt, f"bypass {r}", second, lookup=False)[0])
    rt.close()
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    first, reuse, bypass = (_median(seen[k]) for k in ("first", "second", "bypass"))
    print(f"median of {rounds} round(s); TTFT of every round, ms: "
          + "; ".join(f"{k} " + ", ".join(f"{m.ttft_ms:.1f}" for m in v)
                      for k, v in seen.items()) + "\n")
    if splits:
        print(f"each round's reusing request ({pause_ms:g} ms after the cold one), ms: "
              + "; ".join(f"{k} " + ", ".join(f"{row[k]:.2f}" for row in splits)
                          for k in ("to launch", "device", "to graph", "read")) + "\n")
    print("| request | cached | prefilled | TTFT ms | of which queued | vs first |\n"
          "|---|---|---|---|---|---|")
    for name, m in (("first (cold)", first), ("second (reuse)", reuse),
                    ("second, lookup bypassed", bypass)):
        print(f"| {name} | {m.cached_tokens} | {m.prefilled_tokens} | {m.ttft_ms:.1f} | "
              f"{m.queue_ms:.1f} | {m.ttft_ms / first.ttft_ms:.3f}x |")


class _Marks:
    """The engine's `launch` and `read` wrapped (CUDA): `row(run)` runs one request and
    returns where its time went: its wait to be scheduled (prefix lookup, pages), the
    engine's `launch` on the host, the device from the launch's start to its last kernel
    (of which "to graph" passes before the prefill graph's replay starts: the host
    staging the pass's inputs; on the host, "to stage" from the launch's start to the
    staging, "stage" the staging itself, "replay (host)" the graph's launch call), and
    `read` (waiting for the pick)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.launch, self.read = engine.launch, engine.read
        self.graphs = getattr(engine, "prefill_graphs", None)
        self.m: dict[str, Any] = {}

    def __enter__(self) -> _Marks:
        import torch

        m = self.m

        def timed_launch(batch: Any) -> Any:
            m["e0"] = torch.cuda.Event(enable_timing=True)
            m["e1"] = torch.cuda.Event(enable_timing=True)
            m["e0"].record()
            m["l0"] = time.perf_counter()
            out = self.launch(batch)
            m["l1"] = time.perf_counter()
            m["e1"].record()
            return out

        def timed_read(handle: Any) -> Any:
            m["r0"] = time.perf_counter()
            out = self.read(handle)
            m["r1"] = time.perf_counter()
            return out

        replay = self.graphs.replay if self.graphs is not None else None
        stage = self.graphs.stage if self.graphs is not None else None

        def timed_replay(bucket: int) -> None:
            m["g0"] = torch.cuda.Event(enable_timing=True)
            m["g0"].record()
            assert replay is not None
            m["h0"] = time.perf_counter()
            replay(bucket)
            m["h1"] = time.perf_counter()

        def timed_stage(*args: Any) -> Any:
            m["s0"] = time.perf_counter()
            assert stage is not None
            out = stage(*args)
            m["s1"] = time.perf_counter()
            return out

        self.engine.launch, self.engine.read = timed_launch, timed_read
        if self.graphs is not None:
            self.graphs.replay, self.graphs.stage = timed_replay, timed_stage
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.launch, self.engine.read = self.launch, self.read
        if self.graphs is not None:
            del self.graphs.replay, self.graphs.stage

    def row(self, fn: Callable[..., Any], *args: Any) -> tuple[RequestMetrics, dict[str, float]]:
        """`fn(*args)` (a `run`, or a call of one) and where its request's time went."""
        import torch

        m = self.m
        for k in ("g0", "s0", "s1", "h0", "h1"):
            m.pop(k, None)
        t0 = time.perf_counter()
        metrics = fn(*args)[0]
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return metrics, {"ttft": metrics.ttft_ms, "queue": metrics.queue_ms,
                         "to launch": (m["l0"] - t0) * 1e3,
                         "launch (host)": (m["l1"] - m["l0"]) * 1e3,
                         "device": m["e0"].elapsed_time(m["e1"]),
                         "to graph": m["e0"].elapsed_time(m["g0"]) if "g0" in m else 0.0,
                         "to stage": (m["s0"] - m["l0"]) * 1e3 if "s0" in m else 0.0,
                         "stage": (m["s1"] - m["s0"]) * 1e3 if "s0" in m else 0.0,
                         "replay (host)": (m["h1"] - m["h0"]) * 1e3 if "h0" in m else 0.0,
                         "launch end to read": (m["r0"] - m["l1"]) * 1e3,
                         "read": (m["r1"] - m["r0"]) * 1e3,
                         "read to caller": (t1 - m["r1"]) * 1e3}


def _timeline(rt: InferenceRuntime, prompts: Sequence[list[int]]) -> None:
    """Where a reusing request's time goes (`_Marks`), medians over `prompts`, each run
    right after the one before."""
    with _Marks(rt.engine) as marks:
        rows = [marks.row(run, rt, f"timeline {k}", p)[1] for k, p in enumerate(prompts)]
    print(f"timeline of {len(rows)} reusing requests, medians, ms: " + ", ".join(
        f"{k} {statistics.median(r[k] for r in rows):.3f}" for k in rows[0]) + "\n")


def _gpu_profile(rt: InferenceRuntime, prompt: list[int]) -> None:
    """The GPU kernels of one reusing request, by total time (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run(rt, "profiled", prompt)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


def conversation(model: Model, turns: int, user: int, answer: int) -> None:
    totals = {}
    for reuse in (False, True):
        rt = runtime(model, numpy_engine, turns * (user + answer) + 32, reuse)
        prompt: list[int] = []
        prefilled = 0
        for t in range(turns):
            prompt += tokens(model, user, f"Turn {t}")
            m, out = run(rt, f"t{t}", prompt, max_new=answer)
            prefilled += m.prefilled_tokens
            prompt += out
        totals[reuse] = prefilled
        rt.close()
    print(f"\n{turns}-turn conversation ({user}-token user turns, {answer}-token answers): "
          f"{totals[False]} positions prefilled without reuse, {totals[True]} with "
          f"({totals[True] / totals[False]:.2f}x)")


class _NoText(Tokenizer):
    """Random weights have no vocabulary: ids in, no text out."""

    bos_id = None
    eos_ids = ()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raise NotImplementedError("a random-weight model takes token ids")

    def decode(self, ids: Sequence[int], after_bos: bool = False) -> str:
        return ""


def torch_model(shape: str, **options: Any) -> tuple[Model, Engines]:
    import torch

    from llm_runner_svc.engines.torch_engine import TorchEngine
    from llm_runner_svc.engines.torch_weights import named_shape, random_weights

    config = named_shape(shape)
    weights = random_weights(config, torch.device("cuda"), torch.bfloat16)
    model = Model(name=shape, format="random", config=config, weights=None,  # type: ignore[arg-type]
                  tokenizer=_NoText())
    return model, lambda m: TorchEngine(config, weights, device="cuda", **options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--system", type=int, default=2000)
    ap.add_argument("--user", type=int, default=50)
    ap.add_argument("--turns", type=int, default=0)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--engine", choices=("numpy", "torch"), default="numpy")
    ap.add_argument("--shape", default="qwen2.5-7b", help="the torch engine's model shape")
    ap.add_argument("--profile", action="store_true",
                    help="where the host spends the second request (cProfile)")
    ap.add_argument("--fused-prefill-rows", type=int, default=None,
                    help="the torch engine's option (default: the engine's)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="the torch engine's option (default: the engine's)")
    ap.add_argument("--split-prefill-keys", type=int, choices=(0, 1), default=None,
                    help="the torch engine's option (default: the engine's)")
    ap.add_argument("--short-prefill-rows", type=int, default=None,
                    help="the torch engine's option (default: the engine's)")
    ap.add_argument("--short-tilings", default=None,
                    help="the short products' tilings, as bench_short_products.py --write "
                         "leaves them (JSON)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="cold/reuse rounds, the median reported (default 5 on torch, else 1)")
    ap.add_argument("--gpu-profile", action="store_true",
                    help="the GPU kernels of one reusing request (torch.profiler)")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="idle time between each round's cold request and its reusing one")
    ap.add_argument("--timeline", action="store_true",
                    help="a reusing request's host and device time, step by step (CUDA)")
    args = ap.parse_args()
    if args.engine == "torch":
        options = {k: v for k, v in (("fused_prefill_rows", args.fused_prefill_rows),
                                     ("prefill_graph_tokens", args.prefill_graph_tokens),
                                     ("split_prefill_keys", args.split_prefill_keys),
                                     ("short_prefill_rows", args.short_prefill_rows))
                   if v is not None}
        if args.short_tilings:
            from llm_runner_svc.engines.torch_triton_modes import load_tilings

            options["short_tilings"] = load_tilings(Path(args.short_tilings).read_text())
        model, engine = torch_model(args.shape, **options)
        where = f"{args.shape} (random bf16 weights) on the torch engine, CUDA {options}"
    else:
        model, engine = load_model(args.model), numpy_engine
        where = (f"{args.model} on the numpy engine, {platform.processor() or platform.machine()}"
                 f", {os.cpu_count()} cores")
    print(f"{where}; system prompt {args.system} tokens, user turn {args.user}\n")
    rounds = args.rounds or (5 if args.engine == "torch" else 1)
    ttft(model, engine, args.system, args.user, args.profile, rounds, args.gpu_profile,
         args.timeline, args.pause_ms)
    if args.turns:
        conversation(model, args.turns, args.user, args.answer)


if __name__ == "__main__":
    main()
