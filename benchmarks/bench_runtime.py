"""Prefill and decode throughput of the in-process runtime on the numpy engine.

For each model and batch size: prefill tokens/s (every request's prompt), decode tokens/s
(all rows decoding together), and where a decode step's time goes:
  - engine: `engine.decode` + `engine.sample` alone on the same rows (numpy math plus the
    engine's own Python);
  - runtime: the rest of `runtime.step()` (scheduling, pages, detokenization, events);
  - dispatch: the same engine step on a toy model of the same depth and batch but tiny
    widths, i.e. the fixed Python and per-call cost of issuing the numpy ops.
"Python outside numpy" is runtime + dispatch, as a share of the step.

Usage: python benchmarks/bench_runtime.py [--models stories260K,smollm2] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
import numpy as np

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import DecodeRow, SampleSpec
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


def bench(model: Model, batch: int) -> dict[str, float]:
    max_seq = PROMPT_LEN + DECODE_STEPS + 8
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=batch, max_seq=max_seq, prefill_chunk=128))
    rt.preallocate()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    for i in range(batch):
        prompt = rng.integers(3, vocab, PROMPT_LEN).tolist()
        rt.submit(GenerationRequest(f"b{i}", prompt, SamplingParams(0.8, 50, 0.9, 10_000, seed=i),
                                    ignore_eos=True))
    t0 = time.perf_counter()
    rt.step()  # every request prefills here
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
        "runtime_share": max(0.0, step_s - engine_s) / step_s,
        "dispatch_share": dispatch_s / step_s,
    }


def engine_step_time(rt: InferenceRuntime, batch: int, steps: int = 10) -> float:
    """Seconds per engine decode+sample on `batch` rows at position PROMPT_LEN."""
    ps = rt.config.page_size
    pages = rt.pages.allocate(batch * rt.pages.pages_for(PROMPT_LEN + 1))
    per = len(pages) // batch
    rows = [DecodeRow(5, PROMPT_LEN, pages[i * per:(i + 1) * per]) for i in range(batch)]
    specs = [SampleSpec(0.8, 50, 0.9, 0.5)] * batch
    assert per * ps > PROMPT_LEN
    rt.engine.decode(rows)
    rt.engine.sample(specs)
    t0 = time.perf_counter()
    for _ in range(steps):
        rt.engine.decode(rows)
        rt.engine.sample(specs)
    elapsed = (time.perf_counter() - t0) / steps
    rt.pages.release(pages)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stories260K,smollm2")
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
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
            r = bench(model, b)
            base = base or r["decode_tok_s"]
            print(f"{name:<12} {b:>5} {r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.1f} "
                  f"{r['step_ms']:>8.2f} {r['engine_ms']:>10.2f} {100 * r['runtime_share']:>8.1f}% "
                  f"{100 * r['dispatch_share']:>9.1f}% "
                  f"{100 * (r['runtime_share'] + r['dispatch_share']):>7.1f}% "
                  f"{r['decode_tok_s'] / base:>8.2f}")


if __name__ == "__main__":
    main()
