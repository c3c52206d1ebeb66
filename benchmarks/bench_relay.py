"""Relay capacity of the service path on any machine: the `synthetic` engine (token ids at a set
step time, no model math) behind the Step stream, the orchestrator and the gateway, each timed
at several batch sizes against the runtime alone.

For each batch size B, B requests of --tokens tokens each (ignore_eos) run together, through:
  - in-process: `InferenceRuntime.step()` over the synthetic engine in this process;
  - step: one Step stream with every member, read by a client process (`gpu_paths`);
  - orchestrator: Orchestrator.Generate on `python -m services.orchestrator --workers W`, one
    call per request, the calls spread over --clients client processes;
  - gateway: streamed POST /v1/completions on `python -m services.gateway --workers W` in
    front of that orchestrator, likewise spread over client processes.
The stage runs as its own process (`llm-runner serve`) for the three served paths. Reported
per path: ms per generated token per request (the median over requests of (last delta - first
delta) / tokens after the first, as a caller sees its stream), its ratio to the in-process step,
output tokens/s and deltas/s at that pace (B requests each at it; deltas are the messages a
caller receives: a relay or caller that lags gives several tokens in one), and each server
process's CPU time per 1,000 deltas (user + system from /proc, workers included, over the
whole run), which says where the time goes whatever else the machine runs.

Usage: python benchmarks/bench_relay.py [--batches 1,8,32,64,128,256] [--step-ms 2]
       [--tokens 128] [--workers 1,2] [--paths step,orchestrator,gateway] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.runtime import InferenceRuntime, RuntimeConfig  # noqa: E402

PROMPT = [1, 403, 407, 261, 378, 365, 280, 314]  # a short story opening, as token ids
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its children that still run."""
    total = 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) * TICK_S
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pids.extend(int(c) for c in children)
    return total


def start(cmd: list[str], pattern: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(pattern, line)
    if found is None:
        proc.kill()
        raise RuntimeError(f"{cmd} did not start: {line!r}")
    return proc, found.group(1)


@contextmanager
def running(cmd: list[str], pattern: str) -> Iterator[tuple[subprocess.Popen, str]]:
    proc, address = start(cmd, pattern)
    try:
        yield proc, address
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def in_process_ms(batch: int, args: argparse.Namespace) -> float:
    model = load_model()
    engine = create_engine("synthetic", model.config, model.weights, step_ms=args.step_ms)
    rt = InferenceRuntime(engine, model.tokenizer, RuntimeConfig(
        max_batch=batch, max_seq=len(PROMPT) + args.tokens + 8))
    rt.preallocate()
    try:
        return 1000 * gpu_paths.in_process(rt, [PROMPT] * batch, args.tokens)
    finally:
        rt.close()


# ---- clients (run in child processes: `bench_relay.py --client PATH TARGET TOKENS N`) --------

async def orchestrator_client(target: str, tokens: int, n: int) -> list[list[float]]:
    import grpc

    from services.contract.llmstage.v1 import orchestrator_pb2 as opb
    from services.contract.llmstage.v1 import orchestrator_pb2_grpc
    from services.contract.llmstage.v1 import stage_pb2 as pb

    async with grpc.aio.insecure_channel(target) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def one() -> list[float]:
            req = pb.GenerationRequest(ignore_eos=True, sampling=pb.SamplingOverrides(
                temperature=0.0, max_tokens=tokens))
            req.token_ids.ids.extend(PROMPT)
            stamps = []
            async for ev in stub.Generate(opb.GenerateRequest(request=req)):
                if ev.HasField("delta"):
                    stamps.append((time.perf_counter(), len(ev.delta.token_ids)))
            return _summary(stamps)

        return list(await asyncio.gather(*[one() for _ in range(n)]))


async def gateway_client(target: str, tokens: int, n: int) -> list[list[float]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"http://{target}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}

        async def one() -> list[float]:
            stamps: list[tuple[float, int]] = []
            async with session.post(f"http://{target}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        stamps.append((time.perf_counter(), 1))
                    elif chunk.get("usage") and stamps:
                        # tokens of the request: spread over its text chunks by count
                        total = chunk["usage"]["completion_tokens"]
                        per = total / len(stamps)
                        stamps = [(t, per) for t, _ in stamps]  # type: ignore[misc]
            return _summary(stamps)

        return list(await asyncio.gather(*[one() for _ in range(n)]))


def _summary(stamps: list[tuple[float, float]]) -> list[float]:
    """[first, last, tokens, deltas, seconds per token after the first delta]."""
    tokens = sum(n for _, n in stamps)
    after = sum(n for _, n in stamps[1:])
    per = (stamps[-1][0] - stamps[0][0]) / after if after else 0.0
    return [stamps[0][0], stamps[-1][0], tokens, len(stamps), per]


async def clients(path: str, target: str, tokens: int, batch: int, num_procs: int
                  ) -> list[list[float]]:
    """`batch` requests spread over `num_procs` client processes; every request's summary."""
    shares = [batch // num_procs + (1 if i < batch % num_procs else 0)
              for i in range(num_procs)]
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", path, target, str(tokens), str(n),
        stdout=asyncio.subprocess.PIPE) for n in shares if n]
    out: list[list[float]] = []
    for proc in procs:
        data, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{path} client exited with {proc.returncode}")
        out.extend(json.loads(data))
    return out


def served_row(path: str, target: str, batch: int, args: argparse.Namespace,
               pids: dict[str, int]) -> dict:
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    if path == "step":
        per = asyncio.run(gpu_paths.client_process(
            "grpc_direct", target, [PROMPT] * batch, args.tokens))
        # every member's update of every step is a delta; the rate from the step time
        # (the client process's start is no part of it)
        ms, deltas = 1000 * per, batch * args.tokens
        wall = deltas / (batch * 1000 / ms)
        tokens = deltas
    else:
        reqs = asyncio.run(clients(path, target, args.tokens, batch, args.clients))
        tokens = sum(r[2] for r in reqs)
        deltas = sum(r[3] for r in reqs)
        ms = 1000 * statistics.median(r[4] for r in reqs)
        # steady state: every request's median pace (its admission and first token, which
        # the pace leaves out, are no part of the relay's rate)
        wall = tokens / (batch * 1000 / ms)
    cpu = {name: cpu_s(pid) - before[name] for name, pid in pids.items()}
    return {"tokens_per_s": tokens / wall, "deltas_per_s": deltas / wall, "ms": ms,
            "cpu_ms_per_1k_deltas": {k: 1e6 * v / deltas for k, v in cpu.items()}}


def deployment_files(tmp: Path, args: argparse.Namespace) -> Path:
    stage = tmp / "stage.json"
    stage.write_text(json.dumps({"stages": [{
        "id": "backbone", "runner": "llm.backbone", "artifact": "stories260K",
        "engine": "synthetic", "syntheticStepMs": args.step_ms, "emits": ["text", "tokens"],
        "maxBatch": max(args.batches), "maxSeq": len(PROMPT) + args.tokens + 16}]}))
    return stage


def topology(tmp: Path, stage_target: str) -> Path:
    path = tmp / "topology.json"
    path.write_text(json.dumps({
        "stages": [{"id": "backbone", "runner": "llm.backbone", "endpoints": [stage_target],
                    "emits": ["text", "tokens"], "inputs": ["request:prompt"]}],
        "sinks": ["backbone:text"], "defaultSinks": ["backbone:text"]}))
    return path


def workers_args(n: int) -> list[str]:
    return [] if n == 1 else ["--workers", str(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--paths", default="step,orchestrator,gateway")
    ap.add_argument("--clients", type=int, default=2, help="client processes per run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    paths = args.paths.split(",")
    worker_counts = [int(w) for w in args.workers.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; synthetic engine, {args.step_ms} ms a step, "
          f"{args.tokens} tokens a request", flush=True)
    rows: list[dict] = []
    for b in args.batches:
        rows.append({"path": "in-process", "workers": 1, "batch": b,
                     "ms": in_process_ms(b, args)})
    base = {r["batch"]: r["ms"] for r in rows}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with running(["-m", "llm_runner_svc", "serve", "--port", "0", "--config",
                      str(deployment_files(tmp, args))], r"listening on \S+:(\d+)") as (
                stage, stage_port):
            stage_target = f"127.0.0.1:{stage_port}"
            if "step" in paths:
                for b in args.batches:
                    rows.append({"path": "step", "workers": 1, "batch": b, **served_row(
                        "step", stage_target, b, args, {"stage": stage.pid})})
            for w in worker_counts:
                if not {"orchestrator", "gateway"} & set(paths):
                    break
                with running(["-m", "services.orchestrator", "--topology",
                              str(topology(tmp, stage_target)), "--port", "0",
                              *workers_args(w)], r"listening on \S+:(\d+)") as (orch, port):
                    orch_target = f"127.0.0.1:{port}"
                    if "orchestrator" in paths:
                        for b in args.batches:
                            rows.append({"path": "orchestrator", "workers": w, "batch": b,
                                         **served_row("orchestrator", orch_target, b, args, {
                                             "stage": stage.pid, "orchestrator": orch.pid})})
                    if "gateway" in paths:
                        with running(["-m", "services.gateway", "--orchestrator", orch_target,
                                      "--port", "0", *workers_args(w)],
                                     r"listening on http://\S+:(\d+)") as (gw, gw_port):
                            for b in args.batches:
                                rows.append({"path": "gateway", "workers": w, "batch": b,
                                             **served_row("gateway", f"127.0.0.1:{gw_port}",
                                                          b, args, {
                                                              "stage": stage.pid,
                                                              "orchestrator": orch.pid,
                                                              "gateway": gw.pid})})
    print("| path | workers | batch | ms/token | x in-process | tokens/s | deltas/s | "
          "CPU ms per 1k deltas (stage / orchestrator / gateway) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ms, b = r["ms"], r["batch"]
        if r["path"] == "in-process":
            print(f"| in-process | | {b} | {ms:.2f} | 1.00 | {1000 * b / ms:,.0f} | | |")
            continue
        cpu = r["cpu_ms_per_1k_deltas"]
        cpu_cols = " / ".join(f"{cpu[k]:.0f}" if k in cpu else "-"
                              for k in ("stage", "orchestrator", "gateway"))
        print(f"| {r['path']} | {r['workers']} | {b} | {ms:.2f} | {ms / base[b]:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {r['deltas_per_s']:,.0f} | {cpu_cols} |",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"step_ms": args.step_ms, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        _path, _target, _tokens, _n = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        _run = {"orchestrator": orchestrator_client, "gateway": gateway_client}[_path]
        print(json.dumps(asyncio.run(_run(_target, _tokens, _n))))
    else:
        main()
