"""Tokens/s, TTFT and inter-token latency through the OpenAI-compatible gateway against
calling Orchestrator.Generate directly, at several concurrencies, over the same deployment:
  - orchestrator: asyncio gRPC clients calling Generate on the orchestrator process;
  - gateway: asyncio HTTP clients (aiohttp) streaming POST /v1/completions from the gateway
    process, which calls Generate on that same orchestrator.
Every request generates the same number of tokens (ignore_eos), sampled with its own seed. Each
round runs both modes back to back (their order alternating), so a machine whose load drifts
affects both alike; the tables keep each cell's best round, and the gateway's cost is also
given as the median over rounds of each round's pair. The inter-token latency of a request is
(last text - first text) / (tokens - 1), whatever number of tokens one delta or chunk carries.
The gateway process's own CPU time (user + system, from /proc) per generated token is what it
takes from the cores the stages compute on, a figure that the machine's load does not skew.

On a machine shared with other work, a run during which other processes took more than
--foreign of the cores (from /proc/stat less the CPU time of this benchmark's processes) says
nothing about the gateway: a round counts only when both of its runs were that quiet, and a
round waits (up to a minute) for a quiet second before it starts.

Usage: python benchmarks/bench_gateway.py [--model smollm2|stories260K]
       [--concurrency 1,8,32] [--tokens 32] [--rounds 5] [--foreign 0.15]
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

import aiohttp
import grpc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from deployment import Deployment  # noqa: E402
from http_gateway import GatewayProc  # noqa: E402

PROMPTS = ["Once upon a time", "The dog ran", "Lily and Ben", "One day the sun"]
MODEL_ID = "backbone"  # the deployment's one stage
Timing = tuple[float, float, int]  # first text (s from start), last text (s), tokens


def summarize(mode: str, conc: int, wall_s: float, per_req: list[Timing]) -> dict:
    num_tokens = sum(n for _, _, n in per_req)
    itl = [(last - first) / (n - 1) for first, last, n in per_req if n > 1]
    return {"mode": mode, "concurrency": conc, "tokens_per_s": num_tokens / wall_s,
            "ttft_ms": 1000 * statistics.median(first for first, _, _ in per_req),
            "itl_ms": 1000 * statistics.median(itl) if itl else 0.0}


async def _generate_one(stub: orchestrator_pb2_grpc.OrchestratorStub, i: int, num_tokens: int,
                        t0: float) -> Timing:
    req = opb.GenerateRequest(request=pb.GenerationRequest(
        text=PROMPTS[i % 4], ignore_eos=True,
        sampling=pb.SamplingOverrides(temperature=0.8, max_tokens=num_tokens, seed=i)))
    first = last = 0.0
    n = 0
    async for ev in stub.Generate(req):
        if ev.HasField("delta"):
            last = time.perf_counter() - t0
            first = first or last
            n += len(ev.delta.token_ids)
    return first, last, n


async def _http_one(session: aiohttp.ClientSession, url: str, i: int, num_tokens: int,
                    t0: float) -> Timing:
    body = {"model": MODEL_ID, "prompt": PROMPTS[i % 4], "max_tokens": num_tokens,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = 0.0
    n = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter() - t0
                first = first or last
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return first, last, n


async def run_orchestrator(target: str, conc: int, num_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        t0 = time.perf_counter()
        per = await asyncio.gather(*[_generate_one(stub, i, num_tokens, t0)
                                     for i in range(conc)])
        return summarize("orchestrator", conc, time.perf_counter() - t0, list(per))


async def run_gateway(url: str, conc: int, num_tokens: int) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        per = await asyncio.gather(*[_http_one(session, url, i, num_tokens, t0)
                                     for i in range(conc)])
        return summarize("gateway", conc, time.perf_counter() - t0, list(per))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    """CPU seconds every core of the machine has been busy so far (all processes)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Foreign:
    """The share of the cores that processes other than `pids` took since the last `share()`
    (0: the machine was ours alone)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._mark = self._now()

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), busy_s(), sum(cpu_s(p) for p in self.pids)

    def share(self) -> float:
        (t0, busy0, ours0), (t1, busy1, ours1) = self._mark, self._now()
        self._mark = (t1, busy1, ours1)
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / ((t1 - t0) * (os.cpu_count() or 1))

    def wait_quiet(self, limit: float, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        self.share()
        while time.monotonic() < deadline:
            time.sleep(1.0)  # one second of the machine's load, measured
            if self.share() <= limit:
                return


def measure(dep: Deployment, gw: GatewayProc, conc: int, num_tokens: int, rounds: int,
            limit: float) -> tuple[dict, dict, float, int]:
    """Best orchestrator row, best gateway row (with the gateway's CPU ms per token), the
    median over quiet rounds of the gateway's cost on tokens/s, and how many rounds were
    quiet. Stops after `rounds` quiet rounds or 4 x `rounds` in all."""
    foreign = Foreign([os.getpid(), dep.proc.pid, gw.proc.pid,
                       *(p.proc.pid for p in dep.all_stages)])
    best: dict[str, dict] = {}
    costs: list[float] = []
    gateway_cpu_s = 0.0  # over every run: /proc counts in clock ticks (10 ms)
    num_gateway_runs = 0
    for round_ in range(4 * rounds):
        if len(costs) == rounds:
            break
        foreign.wait_quiet(limit)
        pair, shares = {}, []
        for mode in ("orchestrator", "gateway")[::1 if round_ % 2 == 0 else -1]:
            foreign.share()
            if mode == "orchestrator":
                r = asyncio.run(run_orchestrator(dep.target, conc, num_tokens))
            else:
                cpu0 = cpu_s(gw.proc.pid)
                r = asyncio.run(run_gateway(gw.url, conc, num_tokens))
                gateway_cpu_s += cpu_s(gw.proc.pid) - cpu0
                num_gateway_runs += 1
            shares.append(foreign.share())
            pair[mode] = r
        if max(shares) > limit:
            continue
        for mode, r in pair.items():
            if mode not in best or r["tokens_per_s"] > best[mode]["tokens_per_s"]:
                best[mode] = r
        costs.append(1 - pair["gateway"]["tokens_per_s"] / pair["orchestrator"]["tokens_per_s"])
    if not costs:
        raise SystemExit(f"no quiet round at concurrency {conc}: other work took more than "
                         f"{limit:.0%} of the cores throughout (--foreign)")
    best["gateway"]["gateway_cpu_ms_per_token"] = (1000 * gateway_cpu_s
                                                   / (num_gateway_runs * conc * num_tokens))
    return best["orchestrator"], best["gateway"], statistics.median(costs), len(costs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="quiet rounds per concurrency")
    ap.add_argument("--foreign", type=float, default=0.15,
                    help="a round counts only while other processes took at most this share "
                         "of the cores")
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"model {args.model}, {args.tokens} tokens per request, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment(Path(tmp), {"backbone": {"maxSeq": 512, "maxBatch": 32,
                                                   "artifact": args.model}})
        gw = GatewayProc(dep.target)
        try:
            asyncio.run(run_orchestrator(dep.target, 1, 4))  # warm both paths once
            asyncio.run(run_gateway(gw.url, 1, 4))
            for conc in concs:
                results[conc] = measure(dep, gw, conc, args.tokens, args.rounds,
                                        args.foreign)
        finally:
            gw.stop()
            dep.close()
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    print("| concurrency | path | tokens/s | vs Generate | TTFT ms (median) | ITL ms (median) "
          "| gateway CPU ms/token |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for conc in concs:
        o, g, _, _ = results[conc]
        for name, r in (("Generate (gRPC)", o), ("gateway (HTTP, SSE)", g)):
            cpu = r.get("gateway_cpu_ms_per_token")
            print(f"| {conc} | {name} | {r['tokens_per_s']:,.1f} | "
                  f"{r['tokens_per_s'] / o['tokens_per_s']:.2f} | {r['ttft_ms']:.1f} | "
                  f"{r['itl_ms']:.2f} | {'' if cpu is None else f'{cpu:.3f}'} |")
    for conc in concs:
        o, g, cost, num_quiet = results[conc]
        print(f"gateway cost on tokens/s at concurrency {conc}: median of {num_quiet} quiet "
              f"rounds {100 * cost:.1f}%, best against best "
              f"{100 * (1 - g['tokens_per_s'] / o['tokens_per_s']):.1f}% "
              "(negative: the gateway was faster)")
    print(json.dumps({conc: list(r) for conc, r in results.items()}))


if __name__ == "__main__":
    main()
