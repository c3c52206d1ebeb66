"""A bounded load run against the embedded default (one runner, one orchestrator, loopback):
a fixed number of requests at fixed concurrency, a tenth of them cancelled at random (half by
Orchestrator.Cancel, half by the client going away). No unexpected error, every uncancelled
output equals the same request run alone, memory after the run within 10% of before, and every
counter back at idle.

The default is the full size, 1000 requests at concurrency 64 (about 15 s on 2 cores);
LLMSTAGE_LOAD_REQUESTS and LLMSTAGE_LOAD_CONCURRENCY change it. Before the cohort of a shared
Step stream let go of finished slots, this run grew the runner by 6.5 MiB per 1000 requests.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from accounting import orchestrator_leftovers, runner_leftovers, stage_state, wait_for
from deployment import StageProc, collect, generate_request
from helpers import solo
from rig import Orchestrator, rss_bytes

from llm_runner_svc.models import Model
from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb

NUM_REQUESTS = int(os.environ.get("LLMSTAGE_LOAD_REQUESTS", "1000"))
CONCURRENCY = int(os.environ.get("LLMSTAGE_LOAD_CONCURRENCY", "64"))
PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day", "Tom had a red ball",
           "The sun", "A little bird", "There was a girl"]


def spec(i: int) -> dict[str, Any]:
    """72 distinct requests (8 prompts, 24 seeds, 9 lengths), so solo references stay few."""
    return dict(text=PROMPTS[i % 8], seed=i % 24, max_tokens=24 + i % 9, temperature=0.8)


def one(orch: Orchestrator, i: int, cancel: str | None) -> tuple[str, Any]:
    s = spec(i)
    call = orch.stub.Generate(generate_request(s.pop("text"), request_id=f"load-{i}", **s),
                              timeout=120)
    try:
        if cancel is None:
            return "ok", collect(call)
        first = next(call)
        if cancel == "client":
            call.cancel()
            return "client", first
        orch.stub.Cancel(opb.CancelGenerateRequest(request_id=f"load-{i}"), timeout=10)
        return "cancel", collect([first, *call])
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()


def test_bounded_load(tmp_path: Path, stories: Model) -> None:
    runner = StageProc()
    orch = Orchestrator(tmp_path, {"backbone": [runner.endpoint]})
    reference = functools.lru_cache(maxsize=None)(lambda k: solo(stories, spec(k))[0])
    try:
        pids = {"runner": runner.proc.pid, "orchestrator": orch.proc.pid}
        with ThreadPoolExecutor(CONCURRENCY) as pool:  # warm up: pools, caches, arenas
            assert all(r[0] == "ok" for r in pool.map(lambda i: one(orch, i, None),
                                                      range(2 * CONCURRENCY)))
        before = {name: rss_bytes(pid) for name, pid in pids.items()}
        rng = random.Random(8)
        cancels = {i: rng.choice(["client", "cancel"]) for i in range(NUM_REQUESTS)
                   if rng.random() < 0.1}
        t0 = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda i: one(orch, i, cancels.get(i)),
                                    range(NUM_REQUESTS)))
        took = time.monotonic() - t0
        unexpected = [(i, r) for i, r in enumerate(results)
                      if r[0] not in ("ok", "client", "cancel")]
        assert not unexpected, unexpected[:5]
        for i, (kind, out) in enumerate(results):
            if kind == "ok":
                assert out[0] == reference(i % 72), i  # spec(i) repeats every 72
            elif kind == "cancel":
                assert out[2].finish_reason in (pb.FINISH_REASON_CANCELLED,
                                                pb.FINISH_REASON_MAX_LENGTH,
                                                pb.FINISH_REASON_END_OF_SEQUENCE)
        bad = wait_for(orch.state, orchestrator_leftovers)
        assert not bad, bad
        left = wait_for(lambda: stage_state(runner.stub), lambda s: runner_leftovers(s, 1))
        assert not left, left
        gc.collect()
        after = {name: rss_bytes(pid) for name, pid in pids.items()}
        print(f"\nload: {NUM_REQUESTS} requests at concurrency {CONCURRENCY}, "
              f"{len(cancels)} cancelled, {took:.1f} s; RSS before -> after (MiB): " + ", ".join(
                  f"{n} {before[n] / 2**20:.1f} -> {after[n] / 2**20:.1f}" for n in pids))
        for name in pids:
            assert after[name] <= before[name] * 1.10, (name, before[name], after[name])
    finally:
        orch.stop()
        runner.stop()
