"""One caller that reads slowly beside normal callers, through the orchestrator.

Starts a stage process and an orchestrator process (tests/deployment.py), measures the
orchestrator's idle RSS (/proc/<pid>/status VmRSS, after one warm-up request), then:
  - baseline: `--others` requests of `--other-tokens` tokens each, alone;
  - slow: one `--max-tokens` request (ignore_eos) whose caller reads one delta every
    `--read-interval-s`, with the same other requests started once it runs.
Prints the orchestrator's peak RSS during the slow run minus its idle RSS, the slow request's
stage-side token rate (its Diagnostics) against its caller's read rate, and the other
requests' tokens/s with and without the slow reader.

The slow caller's HTTP/2 window is `--client-window-bytes` (BDP growth off): gRPC's default
window (64 KiB, growing) holds a couple of thousand one-token deltas for a caller that does
not read, which would hide what the orchestrator and the stage do.

Usage: python benchmarks/bench_slow_reader.py [--model stories260K] [--max-tokens 2000]
       [--read-interval-s 1.0] [--others 3] [--other-tokens 256] [--client-window-bytes 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from services.contract.llmstage.v1 import orchestrator_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from deployment import Deployment, collect, generate_request  # noqa: E402

PROMPTS = ["The dog ran", "Lily and Ben", "One day the sun", "Tom had a red ball"]


def rss_kib(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for pid {pid}")


class PeakRss:
    """The highest VmRSS of a process while it runs (sampled every `interval_s`)."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.pid, self.interval_s, self.peak_kib = pid, interval_s, rss_kib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib


def run_others(dep: Deployment, num: int, num_tokens: int) -> list[float]:
    """Tokens/s of each of `num` concurrent requests, call to final report."""
    def one(i: int) -> float:
        t0 = time.perf_counter()
        tokens, _, _ = collect(dep.stub.Generate(generate_request(
            PROMPTS[i % len(PROMPTS)], max_tokens=num_tokens, ignore_eos=True, seed=i),
            timeout=600))
        return len(tokens) / (time.perf_counter() - t0)

    with ThreadPoolExecutor(num) as pool:
        return list(pool.map(one, range(num)))


def slow_run(dep: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    channel = grpc.insecure_channel(dep.target, options=[
        ("grpc.http2.lookahead_bytes", args.client_window_bytes), ("grpc.http2.bdp_probe", 0)])
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    peak = PeakRss(dep.proc.pid)
    call = stub.Generate(generate_request("Once upon a time", max_tokens=args.max_tokens,
                                          ignore_eos=True), timeout=3600)
    first = next(call)
    t_first = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        others = pool.submit(run_others, dep, args.others, args.other_tokens)
        num_tokens, num_deltas, final = len(first.delta.token_ids), 1, None
        for ev in call:
            if ev.HasField("final"):
                final = ev.final
                break
            num_tokens += len(ev.delta.token_ids)
            num_deltas += 1
            time.sleep(args.read_interval_s)  # the slow caller's pace
        t_end = time.perf_counter()
        other_rates = others.result()
    channel.close()
    assert final is not None
    diag = final.diagnostics["backbone"]
    return {"peak_kib": peak.stop(), "other_rates": other_rates, "tokens": num_tokens,
            "deltas": num_deltas, "read_s": t_end - t_first,
            "stage_tokens": int(diag["tokens_out"]),
            "stage_tok_s": float(diag["timings"]["tokens_per_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--max-tokens", type=int, default=2000, help="the slow request's tokens")
    ap.add_argument("--read-interval-s", type=float, default=1.0,
                    help="the slow caller reads one delta this often")
    ap.add_argument("--others", type=int, default=3, help="normal requests beside it")
    ap.add_argument("--other-tokens", type=int, default=256)
    ap.add_argument("--client-window-bytes", type=int, default=1024)
    args = ap.parse_args()
    max_seq = args.max_tokens + 32
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment(Path(tmp), {"backbone": {"maxSeq": max_seq, "artifact": args.model}})
        try:
            run_others(dep, 1, 8)  # warm-up: every lazily loaded path of the orchestrator
            idle_kib = rss_kib(dep.proc.pid)
            baseline = run_others(dep, args.others, args.other_tokens)
            r = slow_run(dep, args)
        finally:
            dep.close()
    print(f"model {args.model}; slow request {args.max_tokens} tokens read one delta every "
          f"{args.read_interval_s} s (client window {args.client_window_bytes} B); "
          f"{args.others} others of {args.other_tokens} tokens")
    print(f"orchestrator RSS: idle {idle_kib / 1024:.1f} MiB, peak {r['peak_kib'] / 1024:.1f} "
          f"MiB during the slow run: +{(r['peak_kib'] - idle_kib) / 1024:.2f} MiB")
    print(f"slow request: {r['stage_tokens']} tokens on the stage at "
          f"{r['stage_tok_s']:.1f} tok/s (its decode time); its caller read {r['tokens']} "
          f"tokens in {r['deltas']} deltas over {r['read_s']:.1f} s = "
          f"{r['tokens'] / r['read_s']:.1f} tok/s, {r['deltas'] / r['read_s']:.2f} deltas/s")
    print(f"other requests: {statistics.median(r['other_rates']):.1f} tok/s each (median) "
          f"beside the slow reader, {statistics.median(baseline):.1f} tok/s without it")


if __name__ == "__main__":
    main()
