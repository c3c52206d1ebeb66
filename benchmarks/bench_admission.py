"""How long Admit takes on large prompts, and whether health keeps answering meanwhile.

For each model it starts an `llm-runner serve` process (default stage config), polls
grpc.health.v1 Check from a thread every 10 ms for the whole run, and times Admit of:
  - a 1,000,000-byte prompt (over the prompt byte limit: INVALID_ARGUMENT before tokenizing),
  - 1, 2, 4 and 8 KB prompts of English text (tokenized; admitted, or refused as too long),
  - 300,000 stop strings, and 2,000,000 token ids (refused),
  - 8 KB prompts on 8 slots at once.
Then, in this process, the llama2.c tokenizer against llama2.c's rescanning merge loop.

Usage, from the repository root:
    PYTHONPATH=. python benchmarks/bench_admission.py [--models stories260K,smollm2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import llm_runner_svc  # noqa: F401  (first: its BLAS settings apply before numpy loads)

# isort: split
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llm_runner_svc.models import load_model
from llm_runner_svc.models.llama2c import Llama2cTokenizer
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the sunshine with her dog, Max. One day, they found a shiny red ball in the park. ")


def text_of(size: int) -> str:
    return (STORY * (size // len(STORY) + 1))[:size]


class HealthPoller:
    """Checks health every `period_s` on its own channel; records every answer's latency."""

    def __init__(self, target: str, period_s: float = 0.01) -> None:
        self.stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        self.period_s = period_s
        self.latencies_ms: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                self.latencies_ms.append((time.perf_counter() - t0) * 1000)
            except grpc.RpcError as exc:
                self.failures.append(str(exc.code()))
            self._stop.wait(self.period_s)


def start_stage(model: str, tmp: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "llm_runner_svc", "serve", "--port", "0"]
    if model != "stories260K":
        path = f"{tmp}/{model}.json"
        with open(path, "w") as f:
            json.dump({"stages": [{"id": "s", "runner": "llm.backbone", "artifact": model}]}, f)
        cmd += ["--config", path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on ([\d.]+:\d+)", line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"the stage did not start: {line!r}")
    return proc, m.group(1)


def admit(stub: stage_pb2_grpc.StageStub, slot: int, text: str | pb.GenerationRequest
          ) -> tuple[float, str]:
    """Admit then Reset one slot; (Admit's ms, its outcome)."""
    gen = pb.GenerationRequest(text=text) if isinstance(text, str) else text
    req = pb.AdmitRequest(slot_id=slot, request=gen)
    t0 = time.perf_counter()
    try:
        ans = stub.Admit(req, timeout=30)
        ms = (time.perf_counter() - t0) * 1000
        outcome = (f"admitted, {ans.prompt_tokens} tokens" if ans.admitted
                   else pb.Refusal.Name(ans.refusal))
    except grpc.RpcError as exc:
        ms = (time.perf_counter() - t0) * 1000
        outcome = exc.code().name
    stub.Reset(pb.ResetRequest(slot_id=slot), timeout=10)
    return ms, outcome


def bench_model(model: str, rounds: int, tmp: str) -> None:
    proc, target = start_stage(model, tmp)
    stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(target))
    try:
        admit(stub, 1, "warm up")
        print(f"\n== {model} (stage at {target}, default config)")
        with HealthPoller(target) as health:
            for size in (1_000_000, 1024, 2048, 4096, 8192):
                runs = [admit(stub, 1, text_of(size)) for _ in range(rounds)]
                ms = [r[0] for r in runs]
                print(f"Admit {size:>9,} bytes: median {statistics.median(ms):7.2f} ms, "
                      f"max {max(ms):7.2f} ms  ({runs[0][1]})")
            for name, gen in (
                    ("300,000 stop strings", pb.GenerationRequest(
                        text="Hi", stop=[f"stop-{i}" for i in range(300_000)])),
                    ("2,000,000 token ids", pb.GenerationRequest(
                        token_ids=pb.TokenIds(ids=[5] * 2_000_000)))):
                ms, outcome = admit(stub, 1, gen)
                print(f"Admit of {name}: {ms:.2f} ms ({outcome})")
            with ThreadPoolExecutor(8) as pool:
                t0 = time.perf_counter()
                runs = list(pool.map(lambda s: admit(stub, s, text_of(8192)), range(10, 18)))
                wall = (time.perf_counter() - t0) * 1000
            print(f"8 Admits of 8,192 bytes at once: all answered in {wall:.1f} ms, "
                  f"slowest {max(r[0] for r in runs):.1f} ms")
        lat = sorted(health.latencies_ms)
        print(f"health meanwhile: {len(lat)} answers, {len(health.failures)} failures, "
              f"median {statistics.median(lat):.2f} ms, p99 {lat[int(len(lat) * 0.99)]:.2f} "
              f"ms, max {lat[-1]:.2f} ms")
    finally:
        proc.terminate()
        proc.wait(10)


def reference_merge() -> Callable[[Llama2cTokenizer, list[int]], list[int]]:
    """llama2.c's rescanning loop (what the tokenizer did before the heap merge), as the
    tokenizer's test keeps it."""
    path = Path(__file__).parent.parent / "tests" / "unit" / "test_llama2c_tokenizer.py"
    spec = importlib.util.spec_from_file_location("llama2c_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cast(Callable[[Llama2cTokenizer, list[int]], list[int]], module.reference_merge)


def bench_tokenizer() -> None:
    tok = load_model().tokenizer
    assert isinstance(tok, Llama2cTokenizer)
    loop_merge = reference_merge()
    print("\n== llama2.c tokenizer in process (stories260K): heap merge vs rescanning loop")
    for size in (1024, 2048, 4096, 8192, 65536, 1_000_000):
        text = text_of(size)
        t0 = time.perf_counter()
        ids = tok.encode(text)
        new_ms = (time.perf_counter() - t0) * 1000
        line = f"{size:>6} bytes -> {len(ids):>5} ids: heap {new_ms:8.2f} ms"
        if size <= 8192:
            initial = [tok.lookup[b" "]] + [tok.lookup.get(c.encode(), 0) for c in text]
            t0 = time.perf_counter()
            old = loop_merge(tok, initial)
            old_ms = (time.perf_counter() - t0) * 1000
            assert [1, *old] == ids
            line += f", loop {old_ms:9.2f} ms ({old_ms / new_ms:.0f}x)"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="stories260K,smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            bench_model(model, args.rounds, tmp)
    bench_tokenizer()


if __name__ == "__main__":
    main()
