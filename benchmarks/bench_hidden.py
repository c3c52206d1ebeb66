"""Hidden-state port throughput: gRPC bytes vs the shared-memory ring, and what a subscriber
costs the decode loop.

1. Transport: this process publishes synthetic decode steps through the stage's own
   HiddenPublisher and Subscribe encoding (batch rows, one [1, hidden] window per row per step,
   embeddings and states) to a whole-stage subscriber in another process, which takes every
   step as one block of numpy arrays in the dtype sent (bfloat16 as its bits; widening to
   float32 is the consumer's own work and the same on both transports) and reads a value of
   each. Reported: MB/s of tensor bytes and hidden messages (rows)/s, per hidden size and dtype,
   for both transports, and the ratio shm / gRPC.
2. Decode slowdown: a real stage (stories260K, hidden port declared) decoding 8 requests
   through a Step stream, with no subscriber, a gRPC-bytes subscriber and a shared-memory one.

Usage: python benchmarks/bench_hidden.py [--sizes 64,896,3584] [--batch 32] [--steps 1000]
       [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
import numpy as np

from llm_runner_svc import codec
from llm_runner_svc.stage.hidden_messages import WireArray
from llm_runner_svc.stage.publish import HiddenPublisher
from llm_runner_svc.stage.shm_budget import ShmBudget
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.server import ServerOptions, create_server

CONSUMER = """
import sys, time, json
from llm_stage_client.hidden import HiddenBlock, HiddenWindow, PortEnd, subscribe_hidden
target, shm, expect_ends = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
warm_rows = int(sys.argv[4])  # rows of the warm-up steps, before the clock starts
n_bytes = n_msgs = n_ends = n_warm = 0
checksum = 0.0
t0 = None
for m in subscribe_hidden(target, None, shared_memory=shm, blocks=True, widen=False,
                          on_subscribed=lambda: print("subscribed", flush=True)):
    if t0 is None and n_warm >= warm_rows:
        t0 = time.perf_counter()
    if t0 is None and isinstance(m, (HiddenBlock, HiddenWindow)):
        n_warm += len(m.token_ids) if isinstance(m, HiddenBlock) else 1
    elif isinstance(m, (HiddenBlock, HiddenWindow)):
        n_bytes += m.embeddings.nbytes + m.states.nbytes
        n_msgs += len(m.token_ids) if isinstance(m, HiddenBlock) else 1
        checksum += float(m.states[-1, -1]) + float(m.embeddings[0, 0])
    else:
        n_ends += 1
        if n_ends == expect_ends:
            break
print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": n_bytes, "messages": n_msgs}))
"""


class _Servicer(stage_pb2_grpc.StageServicer):
    def __init__(self, publisher: HiddenPublisher, subscribed: asyncio.Event) -> None:
        self.publisher, self.subscribed = publisher, subscribed

    async def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> Any:
        sub = await self.publisher.subscribe(None, request.transport == pb.TRANSPORT_SHARED_MEMORY)
        self.subscribed.set()
        try:
            while (msg := await sub.get()) is not None:
                yield codec.port_message_to_pb(msg)
        finally:
            self.publisher.unsubscribe(sub)


async def transport(hidden: int, dtype: str, batch: int, steps: int, shm: bool,
                    warm_steps: int = 50) -> dict:
    publisher = HiddenPublisher("block", 64, 64 << 20, ShmBudget(64 << 20, 8, 1 << 30))
    subscribed = asyncio.Event()
    handle = await create_server(ServerOptions(port=0, max_message_bytes=64 << 20), [
        (stage_pb2_grpc.add_StageServicer_to_server, _Servicer(publisher, subscribed),
         "llmstage.v1.Stage")])
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, f"127.0.0.1:{handle.port}",
                                 "1" if shm else "0", str(batch), str(warm_steps * batch)],
                                stdout=subprocess.PIPE, text=True)
    await subscribed.wait()
    rng = np.random.default_rng(0)
    if dtype == "float32":
        rows: Any = rng.standard_normal((batch, hidden), dtype=np.float32)
    else:
        rows = WireArray(rng.integers(0, 1 << 16, (batch, hidden), dtype=np.uint16),
                         "bfloat16")
    for step in range(warm_steps + steps):
        publisher.begin_step()
        await publisher.publish_rows([(f"r{r}", step, 1, rows[r:r + 1], rows[r:r + 1])
                                      for r in range(batch)])
        await publisher.flush_step()
    publisher.begin_step()
    for r in range(batch):
        await publisher.end(f"r{r}", "max_length", None)
    await publisher.flush_step()
    printed = await asyncio.get_running_loop().run_in_executor(
        None, lambda: consumer.communicate()[0])
    out = json.loads(printed.splitlines()[-1])  # after the "subscribed" line
    await publisher.close()
    await handle.server.stop(0)
    return {"MB_per_s": out["bytes"] / out["seconds"] / 1e6,
            "messages_per_s": out["messages"] / out["seconds"]}


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["MB_per_s"])[len(runs) // 2]


def decode_slowdown(tmp: Path) -> list[tuple[str, float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from deployment import StageProc  # noqa: PLC0415

    cfg = tmp / "stage.json"
    cfg.write_text(json.dumps({"stages": [{"id": "thinker", "runner": "llm.backbone",
                                           "emits": ["text", "tokens", "hidden"],
                                           "maxBatch": 8, "maxSeq": 512}]}))
    stage = StageProc(cfg)
    results = []
    try:
        for mode in ("none", "grpc-bytes", "shared-memory"):
            consumer = None
            if mode != "none":
                consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, stage.endpoint,
                                             "1" if mode == "shared-memory" else "0", "8",
                                             "0"],
                                            stdout=subprocess.PIPE, text=True)
                assert consumer.stdout is not None
                assert consumer.stdout.readline() == "subscribed\n"
            slots = []
            for i in range(8):
                sid = 100 * len(results) + i
                req = pb.GenerationRequest(text="Once upon a time", ignore_eos=True,
                                           request_id=f"{mode}-{i}", ports=["hidden"],
                                           sampling=pb.SamplingOverrides(max_tokens=256, seed=i))
                stage.stub.Admit(pb.AdmitRequest(slot_id=sid, request=req))
                stage.stub.Prepare(pb.PrepareRequest(slot_id=sid))
                slots.append(sid)
            t0 = time.perf_counter()
            ended = 0
            for ev in stage.stub.Step(iter([pb.StepRequest(join=slots, credits=1024)])):
                ended += sum(m.status == pb.MEMBER_STATUS_ENDED for m in ev.members)
            seconds = time.perf_counter() - t0
            for sid in slots:
                stage.stub.Finish(pb.FinishRequest(slot_id=sid))
                stage.stub.Reset(pb.ResetRequest(slot_id=sid))
            if consumer is not None:
                consumer.communicate(timeout=60)
            results.append((mode, 8 * 256 / seconds))
    finally:
        stage.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="64,896,3584")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3, help="runs per cell; the median is shown")
    args = ap.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores; batch {args.batch}, "
          f"{args.steps} steps after 50 warm-up steps; embeddings + states per row; median of "
          f"{args.rounds} rounds")
    print("| hidden | dtype | gRPC MB/s | gRPC msg/s | shm MB/s | shm msg/s | shm / gRPC |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for hidden in [int(s) for s in args.sizes.split(",")]:
        for dtype in ("float32", "bfloat16"):
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for _ in range(args.rounds):  # alternating, so drift hits both alike
                for shm in (False, True):
                    runs[shm].append(asyncio.run(transport(hidden, dtype, args.batch,
                                                           args.steps, shm)))
            g, s = (median_run(runs[False]), median_run(runs[True]))
            print(f"| {hidden} | {dtype} | {g['MB_per_s']:,.1f} | {g['messages_per_s']:,.0f} | "
                  f"{s['MB_per_s']:,.1f} | {s['messages_per_s']:,.0f} | "
                  f"{s['MB_per_s'] / g['MB_per_s']:.2f} |", flush=True)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = decode_slowdown(Path(tmp))
    base = rows[0][1]
    print("\n| subscriber (stories260K, 8 requests x 256 tokens) | decode tok/s | vs none |")
    print("|---|---:|---:|")
    for mode, rate in rows:
        print(f"| {mode} | {rate:,.0f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
