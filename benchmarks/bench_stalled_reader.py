"""A Step client that stops reading, beside three normal requests: do they keep their pace?

Starts `llm-runner serve` (embedded stories260K, numpy engine) as its own process. Round A:
three requests of N tokens, each on its own Step stream, read as fast as they come; their
wall time. Round B: the same, after another client opened a Step stream for a long request
with one credit and stopped reading. Prints both times and their ratio (target: within 1.5x),
then waits for the stalled stream to be ended by the stage's creditIdleTimeoutS and prints how
long that took. Median of --rounds rounds.

Usage: python benchmarks/bench_stalled_reader.py [--tokens 200] [--rounds 5] [--idle-s 2]
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc


def serve(idle_s: float) -> tuple[subprocess.Popen[str], str]:
    cfg = {"stages": [{"id": "backbone", "runner": "llm.backbone", "artifact": "stories260K",
                       "maxBatch": 8, "maxSeq": 512, "creditIdleTimeoutS": idle_s}]}
    path = Path(tempfile.mkdtemp()) / "stage.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "llm_runner_svc", "serve", "--port", "0",
                             "--config", str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    m = re.search(r"listening on ([\d.]+:\d+)", proc.stdout.readline())
    assert m, "the stage did not start"
    return proc, m.group(1)


class Stream:
    def __init__(self, stub: stage_pb2_grpc.StageStub, slot: int, credits: int) -> None:
        self.out: queue.Queue[pb.StepRequest | None] = queue.Queue()
        self.out.put(pb.StepRequest(join=[slot], credits=credits))
        self.call = stub.Step(self._requests())

    def _requests(self) -> Iterator[pb.StepRequest]:
        while (msg := self.out.get()) is not None:
            yield msg


def start(stub: stage_pb2_grpc.StageStub, slot: int, tokens: int) -> None:
    req = pb.GenerationRequest(text="Once upon a time", ignore_eos=True,
                               sampling=pb.SamplingOverrides(max_tokens=tokens, seed=slot))
    assert stub.Admit(pb.AdmitRequest(slot_id=slot, request=req)).admitted
    stub.Prepare(pb.PrepareRequest(slot_id=slot))


def run_one(stub: stage_pb2_grpc.StageStub, slot: int, tokens: int) -> None:
    start(stub, slot, tokens)
    stream = Stream(stub, slot, 64)
    for ev in stream.call:
        stream.out.put(pb.StepRequest(credits=1))
        if any(m.status == pb.MEMBER_STATUS_ENDED for m in ev.members):
            break
    stream.out.put(None)
    stub.Finish(pb.FinishRequest(slot_id=slot))
    stub.Reset(pb.ResetRequest(slot_id=slot))


def three(stub: stage_pb2_grpc.StageStub, base: int, tokens: int) -> float:
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run_one, args=(stub, base + i, tokens)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle-s", type=float, default=2.0)
    args = ap.parse_args()
    proc, endpoint = serve(args.idle_s)
    try:
        stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(endpoint))
        alone, beside, ended = [], [], []
        for r in range(args.rounds):
            alone.append(three(stub, 100 * r + 10, args.tokens))
            start(stub, 100 * r + 1, 400)
            stalled = Stream(stub, 100 * r + 1, 1)
            next(stalled.call)  # its one credit spent; it reads no more
            t_stall = time.perf_counter()
            beside.append(three(stub, 100 * r + 20, args.tokens))
            try:
                next(stalled.call)
            except grpc.RpcError as exc:
                ended.append(time.perf_counter() - t_stall)
                code = exc.code().name
            stalled.out.put(None)
        a, b = statistics.median(alone), statistics.median(beside)
        print(f"three requests of {args.tokens} tokens, median of {args.rounds} rounds")
        print("| case | wall s | ratio |")
        print("|---|---:|---:|")
        print(f"| alone | {a:.3f} | 1.00 |")
        print(f"| beside a Step client that stopped reading | {b:.3f} | {b / a:.2f} |")
        print(f"stalled stream ended {code} after {statistics.median(ended):.2f} s "
              f"(creditIdleTimeoutS {args.idle_s:g})")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
