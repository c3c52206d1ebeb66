"""Prefix reuse on the numpy engine: time to first token of a request whose long system
prompt is cached, against the first request that prefilled it.

Each request is a shared system prompt of --system tokens plus its own user turn of --user
tokens, generating one token. The first request fills the cache; the second reuses every
full page of the system prompt and prefills the rest. A third runs the second's prompt with
the lookup bypassed: the cost without reuse on a warm process. With --turns N, an N-turn
conversation (each turn repeats the previous prompt and answer and adds a user turn) counts
the prefilled positions with and without reuse.

Usage: python benchmarks/bench_prefix_cache.py [--model smollm2] [--system 2000] [--user 50]
                                               [--turns 8]
"""

from __future__ import annotations

import argparse
import os
import platform

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
from llm_runner_svc.engines import create_engine
from llm_runner_svc.models import Model, load_model
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
    """`n` token ids of English text, different for each `salt`."""
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


def runtime(model: Model, max_seq: int, reuse: bool) -> InferenceRuntime:
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=1, max_seq=max_seq, prefix_cache=reuse))
    rt.preallocate()
    return rt


def ttft(model: Model, system: int, user: int) -> None:
    sys_ids = tokens(model, system, "System")
    rt = runtime(model, system + user + 16, True)
    first, _ = run(rt, "first", sys_ids + tokens(model, user, "Question A"))
    second, _ = run(rt, "second", sys_ids + tokens(model, user, "Question B"))
    bypass, _ = run(rt, "bypass", sys_ids + tokens(model, user, "Question B"), lookup=False)
    rt.close()
    print("| request | cached | prefilled | TTFT ms | vs first |\n|---|---|---|---|---|")
    for name, m in (("first (cold)", first), ("second (reuse)", second),
                    ("second, lookup bypassed", bypass)):
        print(f"| {name} | {m.cached_tokens} | {m.prefilled_tokens} | {m.ttft_ms:.1f} | "
              f"{m.ttft_ms / first.ttft_ms:.3f}x |")


def conversation(model: Model, turns: int, user: int, answer: int) -> None:
    totals = {}
    for reuse in (False, True):
        rt = runtime(model, turns * (user + answer) + 32, reuse)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--system", type=int, default=2000)
    ap.add_argument("--user", type=int, default=50)
    ap.add_argument("--turns", type=int, default=0)
    ap.add_argument("--answer", type=int, default=16)
    args = ap.parse_args()
    model = load_model(args.model)
    print(f"{args.model} on the numpy engine, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; system prompt {args.system} tokens, user turn {args.user}\n")
    ttft(model, args.system, args.user)
    if args.turns:
        conversation(model, args.turns, args.user, args.answer)


if __name__ == "__main__":
    main()
