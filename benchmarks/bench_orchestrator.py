"""TTFT, inter-token latency and tokens/s three ways, at several concurrencies:
  - in-process: the runtime alone (submit every request, step until all end);
  - direct: clients calling the runner's Stage service themselves (Admit, Prepare, Step);
  - orchestrator: clients calling Orchestrator.Generate over the same runner process;
    with `--workers 1,2` once per worker count (the orchestrator's `--workers`), the calls
    dealt over `--channels` connections so that they reach every worker.
Every request generates the same number of tokens (ignore_eos). Each mode runs on a fresh
runner process started by this script; the in-process mode runs in this process.

Usage: python benchmarks/bench_orchestrator.py [--model stories260K|smollm2]
       [--concurrency 1,8,32] [--tokens 64] [--rounds 2] [--workers 1] [--channels 8]
       [--modes in-process,direct,orchestrator]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
import grpc

from llm_runner_svc.engines import create_engine
from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve
from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc, stage_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from deployment import Deployment  # noqa: E402

PROMPTS = ["Once upon a time", "The dog ran", "Lily and Ben", "One day the sun"]


def summarize(mode: str, conc: int, wall_s: float, per_req: list[tuple[float, list[float]]],
              num_tokens: int) -> dict:
    ttft = [t for t, _ in per_req]
    gaps = [g for _, gs in per_req for g in gs]
    return {"mode": mode, "concurrency": conc, "tokens_per_s": conc * num_tokens / wall_s,
            "ttft_ms": 1000 * statistics.median(ttft),
            "itl_ms": 1000 * statistics.median(gaps) if gaps else 0.0}


def in_process(model_name: str, conc: int, num_tokens: int) -> dict:
    model = load_model(model_name)
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=max(conc, 8), max_seq=512))
    rt.preallocate()
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {}
    for i in range(conc):
        ids = model.tokenizer.encode(PROMPTS[i % 4])
        rt.submit(GenerationRequest(f"r{i}", ids, resolve(
            rt.config.sampling, temperature=0.8, max_new_tokens=num_tokens, seed=i),
            ignore_eos=True))
    while rt.has_work:
        for ev in rt.step():
            now = time.perf_counter()
            if ev.token_ids:
                if ev.request_id not in first:
                    first[ev.request_id] = now - t0
                else:
                    gaps.setdefault(ev.request_id, []).append(now - last[ev.request_id])
                last[ev.request_id] = now
    wall = time.perf_counter() - t0
    rt.close()
    return summarize("in-process", conc, wall, [(first[r], gaps.get(r, [])) for r in first],
                     num_tokens)


async def _direct_one(stub: stage_pb2_grpc.StageStub, slot: int, i: int, num_tokens: int,
                      t0: float) -> tuple[float, list[float]]:
    req = pb.GenerationRequest(text=PROMPTS[i % 4], ignore_eos=True, sampling=pb.SamplingOverrides(
        temperature=0.8, max_tokens=num_tokens, seed=i))
    await stub.Admit(pb.AdmitRequest(slot_id=slot, request=req))
    await stub.Prepare(pb.PrepareRequest(slot_id=slot))
    q: asyncio.Queue = asyncio.Queue()
    q.put_nowait(pb.StepRequest(join=[slot], credits=64))

    async def requests():
        while (m := await q.get()) is not None:
            yield m

    first, last, gaps = None, 0.0, []
    async for ev in stub.Step(requests()):
        q.put_nowait(pb.StepRequest(credits=1))
        now = time.perf_counter()
        m = ev.members[0]
        if m.token_ids:
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
        if m.status == pb.MEMBER_STATUS_ENDED:
            q.put_nowait(None)
    await stub.Finish(pb.FinishRequest(slot_id=slot))
    await stub.Reset(pb.ResetRequest(slot_id=slot))
    return first or 0.0, gaps


async def _orch_one(stub: orchestrator_pb2_grpc.OrchestratorStub, i: int, num_tokens: int,
                    t0: float) -> tuple[float, list[float]]:
    req = opb.GenerateRequest(request=pb.GenerationRequest(
        text=PROMPTS[i % 4], ignore_eos=True,
        sampling=pb.SamplingOverrides(temperature=0.8, max_tokens=num_tokens, seed=i)))
    first, last, gaps = None, 0.0, []
    async for ev in stub.Generate(req):
        if ev.HasField("delta"):
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:  # a delta gathers several tokens for a caller that lags: per token
                n = max(1, len(ev.delta.token_ids))
                gaps += [(now - last) / n] * n
            last = now
    return first or 0.0, gaps


async def over_grpc(mode: str, target: str, conc: int, num_tokens: int,
                    num_channels: int = 1) -> dict:
    # Each channel its own connection (a private subchannel pool): the kernel deals each
    # connection to one of the orchestrator's workers.
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(num_channels)]
    try:
        t0 = time.perf_counter()
        if mode == "direct":
            stub = stage_pb2_grpc.StageStub(chans[0])
            per = await asyncio.gather(*[_direct_one(stub, 10_000 + i, i, num_tokens, t0)
                                         for i in range(conc)])
        else:
            ostubs = [orchestrator_pb2_grpc.OrchestratorStub(c) for c in chans]
            per = await asyncio.gather(*[_orch_one(ostubs[i % num_channels], i, num_tokens, t0)
                                         for i in range(conc)])
        return summarize(mode, conc, time.perf_counter() - t0, list(per), num_tokens)
    finally:
        for c in chans:
            await c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="runs per cell; the best is kept")
    ap.add_argument("--workers", default="1", help="the orchestrator's worker counts to run")
    ap.add_argument("--channels", type=int, default=8,
                    help="client connections the orchestrator's calls are dealt over")
    ap.add_argument("--modes", default="in-process,direct,orchestrator")
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",")]
    modes = args.modes.split(",")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"model {args.model}, {args.tokens} tokens per request")
    rows = []
    for workers in worker_counts:
        with tempfile.TemporaryDirectory() as tmp:
            dep = Deployment(Path(tmp), {"backbone": {"maxSeq": 512, "maxBatch": 64,
                                                       "artifact": args.model}},
                             workers=workers)
            try:
                direct_target = dep.all_stages[0].endpoint
                for conc in concs:
                    for mode in modes:
                        if mode != "orchestrator" and workers != worker_counts[0]:
                            continue
                        best = None
                        for _ in range(args.rounds):
                            if mode == "in-process":
                                r = in_process(args.model, conc, args.tokens)
                            else:
                                target = direct_target if mode == "direct" else dep.target
                                r = asyncio.run(over_grpc(mode, target, conc, args.tokens,
                                                          args.channels))
                            if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                                best = r
                        assert best is not None
                        if mode == "orchestrator" and len(worker_counts) > 1:
                            best["mode"] = f"orchestrator x{workers}"
                        rows.append(best)
            finally:
                dep.close()
    print("| concurrency | mode | tokens/s | vs in-process | TTFT ms (median) | ITL ms (median) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        base = next((b for b in rows if b["concurrency"] == r["concurrency"]
                     and b["mode"] == "in-process"), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        print(f"| {r['concurrency']} | {r['mode']} | {r['tokens_per_s']:,.1f} | "
              f"{ratio} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} |")
    for conc in concs:
        d = next((r for r in rows if r["concurrency"] == conc and r["mode"] == "direct"), None)
        o = next((r for r in rows if r["concurrency"] == conc
                  and r["mode"].startswith("orchestrator")), None)
        if d is None or o is None:
            continue
        print(f"orchestrator overhead on tokens/s at concurrency {conc}: "
              f"{100 * (1 - o['tokens_per_s'] / d['tokens_per_s']):.1f}% vs direct "
              "(negative: the orchestrator is faster)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
