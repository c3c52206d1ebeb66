"""Prefill and decode throughput of the in-process runtime on the numpy engine.

For each model and batch size: prefill tokens/s (every request's prompt), decode tokens/s
(all rows decoding together), and where a decode step's time goes:
  - engine: the engine's step alone on the same rows (one launch + read of the batch, as
    `runtime.step()` issues it: numpy math plus the engine's own Python);
  - runtime: the rest of `runtime.step()` (scheduling, pages, detokenization, events);
  - dispatch: the same engine step on a toy model of the same depth and batch but tiny
    widths, i.e. the fixed Python and per-call cost of issuing the numpy ops.
Each share is of the runtime's step time; "Python outside numpy" is runtime + dispatch.

With --hidden-layer, the deployment declares the hidden port (nothing is captured): prompt
tokens then run by aligned blocks of the page size, as the hidden port needs.

With --stall: while 4 requests decode, a 1,024-token prompt joins; prints the longest step
against the median decode step before it, with the whole prompt in one step (an unlimited
token budget, the behaviour before chunked prefill) and with each budget of --budgets
(`default`: the engine's own, `Engine.default_step_tokens`), and the same prompt's time to
first token alone (nothing else running) at that budget: what the short steps cost. With
--repeats N every case runs N times and each step keeps its least time (other work on a
loaded machine only ever adds time to a step).

Usage: python benchmarks/bench_runtime.py [--models stories260K,smollm2] [--batches 1,8,32]
                                         [--hidden-layer -1]
       python benchmarks/bench_runtime.py --stall --models smollm2 [--budgets default,16,32]
           [--cpu-clock] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
import numpy as np

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.batch import Batch, Row, SampleSpec
from llm_runner_svc.models import Model, load_model
from llm_runner_svc.models.spec import LayerWeights, ModelConfig, ModelWeights
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SamplingParams,
)

PROMPT_LEN = 64
DECODE_STEPS = 24
STALL_DECODERS = 4
STALL_PROMPT = 1024
UNLIMITED = 1 << 30


def toy_like(cfg: ModelConfig) -> tuple[ModelConfig, ModelWeights]:
    """Same depth and head layout, widths of a few units: its step cost is pure dispatch."""
    c = ModelConfig(arch="toy", vocab_size=cfg.vocab_size, hidden_size=8,
                    intermediate_size=8, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads, head_dim=2, max_position=cfg.max_position,
                    rope_style=cfg.rope_style)
    z = lambda *s: np.full(s, 0.01, np.float32)  # noqa: E731
    layers = [LayerWeights(z(8), z(c.q_dim, 8), z(c.kv_dim, 8), z(c.kv_dim, 8), z(8, c.q_dim),
                           z(8), z(8, 8), z(8, 8), z(8, 8)) for _ in range(c.num_layers)]
    return c, ModelWeights(embedding=z(c.vocab_size, 8), layers=layers, final_norm=z(8))


def bench(model: Model, batch: int, hidden_layer: int | None = None) -> dict[str, float]:
    max_seq = PROMPT_LEN + DECODE_STEPS + 8
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=batch, max_seq=max_seq, prefill_chunk=128,
                                        max_tokens_per_step=UNLIMITED,
                                        hidden_layer=hidden_layer))
    rt.preallocate()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    for i in range(batch):
        prompt = rng.integers(3, vocab, PROMPT_LEN).tolist()
        rt.submit(GenerationRequest(f"b{i}", prompt, SamplingParams(0.8, 50, 0.9, 10_000, seed=i),
                                    ignore_eos=True))
    t0 = time.perf_counter()
    while any(not ev.token_ids for ev in rt.step()):  # until every request has its first token
        pass
    prefill_s = time.perf_counter() - t0
    rt.step()  # warm-up decode
    t0 = time.perf_counter()
    for _ in range(DECODE_STEPS):
        rt.step()
    step_s = (time.perf_counter() - t0) / DECODE_STEPS
    for i in range(batch):
        rt.cancel(f"b{i}")
    rt.step()
    engine_s = engine_step_time(rt, batch)
    rt.close()
    toy_cfg, toy_w = toy_like(model.config)
    toy = InferenceRuntime(create_engine("numpy", toy_cfg, toy_w), model.tokenizer,
                           RuntimeConfig(max_batch=batch, max_seq=max_seq))
    toy.preallocate()
    dispatch_s = engine_step_time(toy, batch)
    toy.close()
    return {
        "prefill_tok_s": batch * PROMPT_LEN / prefill_s,
        "decode_tok_s": batch / step_s,
        "step_ms": step_s * 1e3,
        "engine_ms": engine_s * 1e3,
        **step_shares(step_s, engine_s, dispatch_s),
    }


def step_shares(step_s: float, engine_s: float, dispatch_s: float) -> dict[str, float]:
    """The runtime's and the dispatch's shares of a runtime step of `step_s`: the runtime is
    what the step spends beyond the engine's `engine_s`; the dispatch is the part of the
    engine step a toy model of the same depth also costs (`dispatch_s`), so no more than
    the engine step (a toy timed above it, as stories260K's tiny widths allow, or a noisy
    measurement, is all of it). Each lies in [0, 1], and so does their sum."""
    engine_in_step_s = min(engine_s, step_s)
    return {"runtime_share": (step_s - engine_in_step_s) / step_s,
            "dispatch_share": min(dispatch_s, engine_in_step_s) / step_s}


def engine_step_time(rt: InferenceRuntime, batch: int, steps: int = 10) -> float:
    """Seconds per engine step of `batch` decode rows at position PROMPT_LEN, each with a
    top-k/top-p pick: one launch + read of a Batch, the path `runtime.step()` takes, so the
    real model's time is part of the step it is compared with and the toy's is not more
    than the real one's."""
    ps = rt.config.page_size
    pages = rt.pages.allocate(batch * rt.pages.pages_for(PROMPT_LEN + 1))
    per = len(pages) // batch
    assert per * ps > PROMPT_LEN
    spec = SampleSpec(0.8, 50, 0.9, 0.5)
    step = Batch([Row((5,), PROMPT_LEN, pages[i * per:(i + 1) * per], spec, prompt_end=0)
                  for i in range(batch)])
    rt.engine.read(rt.engine.launch(step))
    t0 = time.perf_counter()
    for _ in range(steps):
        rt.engine.read(rt.engine.launch(step))
    elapsed = (time.perf_counter() - t0) / steps
    rt.pages.release(pages)
    return elapsed


def stall_runtime(model: Model, budget: int) -> InferenceRuntime:
    """The runtime of the stall measurement; `budget` 0: the engine's default."""
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=STALL_DECODERS + 1,
                                        max_seq=STALL_PROMPT + 256, max_tokens_per_step=budget))
    rt.preallocate()
    return rt


def steps_to_first_token(rt: InferenceRuntime, prompt: list[int],
                         clock: Callable[[], float]) -> list[float]:
    """Submit `prompt` and step until its first token; each step's time."""
    rt.submit(GenerationRequest("long", prompt, SamplingParams(0.0, 1, 1.0, 4),
                                ignore_eos=True))
    during, first = [], False
    while not first:
        t0 = clock()
        events = rt.step()
        during.append(clock() - t0)
        first = any(ev.request_id == "long" and ev.token_ids for ev in events)
    return during


def alone_steps(model: Model, budget: int, clock: Callable[[], float]) -> list[float]:
    """Step times until the first token of a STALL_PROMPT-token prompt with nothing else
    running (after a short warm-up request): the prefill's own cost at this budget."""
    rt = stall_runtime(model, budget)
    rng = np.random.default_rng(1)
    rt.submit(GenerationRequest("warm", rng.integers(3, model.config.vocab_size, 16).tolist(),
                                SamplingParams(0.0, 1, 1.0, 2), ignore_eos=True))
    while rt.has_work:
        rt.step()
    during = steps_to_first_token(
        rt, rng.integers(3, model.config.vocab_size, STALL_PROMPT).tolist(), clock)
    rt.close()
    return during


def least(runs: list[list[float]]) -> list[float]:
    """Each step's least time over identical runs (the same steps every run): a loaded
    machine only ever adds time to a step."""
    return [min(times) for times in zip(*runs, strict=True)]


def stall_steps(model: Model, budget: int, clock: Callable[[], float]
                ) -> tuple[int, list[float], list[float]]:
    """Tokens per step, and step times while STALL_DECODERS requests decode: DECODE_STEPS
    before a STALL_PROMPT-token prompt joins, then every step until its first token."""
    rt = stall_runtime(model, budget)
    tokens = rt.step_tokens
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    for i in range(STALL_DECODERS):
        rt.submit(GenerationRequest(f"d{i}", rng.integers(3, vocab, 16).tolist(),
                                    SamplingParams(0.0, 1, 1.0, 10_000), ignore_eos=True))
    for _ in range(4):  # prefills and warm-up
        rt.step()
    before = []
    for _ in range(DECODE_STEPS):
        t0 = clock()
        rt.step()
        before.append(clock() - t0)
    during = steps_to_first_token(rt, rng.integers(3, vocab, STALL_PROMPT).tolist(), clock)
    rt.close()
    return tokens, before, during


def stall(model: Model, budget: int, clock: Callable[[], float],
          repeats: int) -> dict[str, float]:
    """The median decode step before the join, the longest step until the first token, and
    the times to first token, with each step's least time over `repeats` runs.
    `clock`: wall time, or the stepping thread's CPU time (steadier on a loaded machine)."""
    runs = [stall_steps(model, budget, clock) for _ in range(repeats)]
    before, during = least([r[1] for r in runs]), least([r[2] for r in runs])
    alone = least([alone_steps(model, budget, clock) for _ in range(repeats)])
    median = float(np.median(before))
    print("  longest steps ms:", [round(x * 1e3) for x in sorted(during)[-4:]],
          "at", sorted(range(len(during)), key=during.__getitem__)[-4:])
    return {"tokens": runs[0][0], "median_ms": median * 1e3, "longest_ms": max(during) * 1e3,
            "ratio": max(during) / median, "steps": len(during),
            "ttft_ms": sum(during) * 1e3, "alone_ttft_ms": sum(alone) * 1e3}


def parse_budgets(text: str) -> list[int]:
    """`default,16,32` -> [0, 16, 32] (0: the engine's default budget)."""
    return [0 if x == "default" else int(x) for x in text.split(",")]


def budget_label(budget: int, tokens: int) -> str:
    if budget == UNLIMITED:
        return "unlimited"
    return f"default {tokens}" if budget == 0 else str(tokens)


def main_stall(models: list[str], budgets: list[int], cpu_clock: bool, repeats: int) -> None:
    clock = time.thread_time if cpu_clock else time.perf_counter
    print(f"{STALL_DECODERS} requests decoding, a {STALL_PROMPT}-token prompt joins; "
          f"{'CPU time of the stepping thread' if cpu_clock else 'wall time'}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(auto)')}, "
          f"each step's least over {repeats} run(s)")
    print(f"{'model':<12} {'tokens/step':>11} {'median decode ms':>16} {'longest step ms':>15} "
          f"{'ratio':>6} {'steps to 1st token':>18} {'TTFT ms':>8} {'alone TTFT ms':>13}")
    for name in models:
        model = load_model(name)
        for budget in [UNLIMITED, *budgets]:
            r = stall(model, budget, clock, repeats)
            label = budget_label(budget, int(r["tokens"]))
            print(f"{name:<12} {label:>11} {r['median_ms']:>16.1f} {r['longest_ms']:>15.1f} "
                  f"{r['ratio']:>6.1f} {r['steps']:>18.0f} {r['ttft_ms']:>8.0f} "
                  f"{r['alone_ttft_ms']:>13.0f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stories260K,smollm2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--stall", action="store_true", help="the join-stall measurement")
    ap.add_argument("--hidden-layer", type=int, default=None,
                    help="declare the hidden port (accept_hidden_layer); nothing is captured")
    ap.add_argument("--budgets", default="default,16,32",
                    help="tokens per step for --stall; `default`: the engine's own")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="--stall times the stepping thread's CPU time (a loaded machine; run "
                         "with OPENBLAS_NUM_THREADS=1 so BLAS works on that thread)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--stall runs each case this often and keeps each step's least time")
    args = ap.parse_args()
    if args.stall:
        main_stall(args.models.split(","), parse_budgets(args.budgets), args.cpu_clock,
                   args.repeats)
        return
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} "
          f"python={platform.python_version()} numpy={np.__version__} "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(auto)')}")
    print(f"prompt={PROMPT_LEN} tokens, {DECODE_STEPS} timed decode steps, top-k/top-p sampling")
    header = (f"{'model':<12} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} "
              f"{'step ms':>8} {'engine ms':>10} {'runtime %':>9} {'dispatch %':>10} "
              f"{'python %':>8} {'x batch1':>8}")
    print(header)
    for name in args.models.split(","):
        model = load_model(name)
        base = None
        for b in [int(x) for x in args.batches.split(",")]:
            r = bench(model, b, args.hidden_layer)
            base = base or r["decode_tok_s"]
            print(f"{name:<12} {b:>5} {r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.1f} "
                  f"{r['step_ms']:>8.2f} {r['engine_ms']:>10.2f} {100 * r['runtime_share']:>8.1f}% "
                  f"{100 * r['dispatch_share']:>9.1f}% "
                  f"{100 * (r['runtime_share'] + r['dispatch_share']):>7.1f}% "
                  f"{r['decode_tok_s'] / base:>8.2f}")


if __name__ == "__main__":
    main()
