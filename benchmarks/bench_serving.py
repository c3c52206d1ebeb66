"""Serving through the OpenAI-compatible gateway, driven by an external load generator (AIPerf,
the `aiperf` package of the `bench` extra), against calling Orchestrator.Generate directly.

For each point of a sweep (a concurrency, or a request rate with Poisson arrivals) AIPerf sends
fixed-length synthetic requests (`--isl` prompt tokens, `--osl` output tokens with ignore_eos)
as streaming `/v1/completions` (or `/v1/chat/completions`) calls, counting tokens from the
server's `usage`, and exports its summary as JSON; the table gives TTFT and inter-token latency
(p50, p99), output tokens/s, and goodput: the requests that met both `--slo-ttft-ms` and
`--slo-itl-ms`. For each concurrency the same prompts then go to Orchestrator.Generate from
asyncio gRPC clients at that concurrency (the gateway's path less HTTP), and the gateway's
output tokens/s over theirs is printed. "load generator cores" is the CPU AIPerf's processes
took over their whole run (start-up included) in cores: on a machine with few cores the tool
competes with the deployment for them, and the gateway / Generate ratio carries that as well
as the gateway's own cost (which benchmarks/bench_gateway.py measures alone). "other load" is
the share of the cores that processes outside this benchmark's tree took during the point (the
larger of its two runs'): on a shared machine, a row with much of it says more about the
neighbours than about the gateway, so each run first waits (up to --quiet-wait-s) for a second
in which that share was at most --quiet.

The tokenizer AIPerf synthesizes prompts with is the served model's own, written as a local
Hugging Face hub entry (serving_tokenizer.py): nothing is downloaded (HF_HUB_OFFLINE=1).

AIPerf pins many packages of its own; install it in a venv of its own and name that venv's
python (`--tool-python`):
    python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf==0.13.0
    python benchmarks/bench_serving.py --tool-python /tmp/aiperf/bin/python \
        [--model stories260K|smollm2|PATH] [--engine numpy|synthetic ...] [--workers N]
        [--concurrency 1,8,32,64] [--rates 10,20,40] [--isl 32] [--osl 32]
        [--slo-ttft-ms 500] [--slo-itl-ms 50] [--url http://HOST:PORT --orchestrator HOST:PORT]
Without --url it starts a deployment (`llm-runner up` on a topology of one stage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_tokenizer import create_hub_entry  # noqa: E402

TOOL_VERSION = "0.13.0"
STAGE_ID = "backbone"
TOOL_CORES = "bench_serving_tool_cores"  # added to the tool's summary: its CPU over its run


class ToolError(RuntimeError):
    """The load generator failed, or its export says what this benchmark cannot use."""


class DeploymentError(RuntimeError):
    """`llm-runner up` did not come up."""


@dataclass(frozen=True)
class Point:
    """One point of the sweep: a closed loop of `concurrency` requests, or `rate` requests/s."""

    concurrency: int = 0
    rate: float = 0.0

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"


# ---- the deployment ------------------------------------------------------------------------

class Up:
    """`llm-runner up` on a one-stage topology written into `tmp`; stopped by `close()`."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        stage: dict[str, Any] = {"id": STAGE_ID, "runner": "llm.backbone",
                                 "artifact": args.model, "engine": args.engine,
                                 "emits": ["text", "tokens"], "maxBatch": args.max_batch,
                                 "maxSeq": args.max_seq}
        if args.engine == "synthetic":
            stage["syntheticStepMs"] = args.synthetic_step_ms
        (tmp / "stage.json").write_text(json.dumps({"stages": [stage]}))
        topology = {"stages": [{"id": STAGE_ID, "runner": "llm.backbone",
                                "emits": ["text", "tokens"], "inputs": ["request:prompt"],
                                "launch": {"config": "stage.json"}}],
                    "sinks": [f"{STAGE_ID}:text"], "defaultSinks": [f"{STAGE_ID}:text"],
                    "maxRunning": args.max_batch, "maxQueued": 4096}
        (tmp / "topology.json").write_text(json.dumps(topology))
        cmd = [sys.executable, "-m", "llm_runner_svc", "up", "--topology",
               str(tmp / "topology.json"), "--port", "0", "--http-port", "0"]
        if args.workers is not None:
            if "--workers" not in _up_help():
                raise DeploymentError("this build's `llm-runner up` takes no --workers")
            cmd += ["--workers", str(args.workers)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        self.orchestrator = self.url = ""
        while not (self.orchestrator and self.url):
            line = self.proc.stdout.readline()
            if not line:
                self.close()
                raise DeploymentError(f"llm-runner up exited ({self.proc.poll()}) before its "
                                      "gateway listened (its error is above)")
            words = line.split()
            if "orchestrator listening on" in line:
                self.orchestrator = words[words.index("on") + 1]
            elif "gateway listening on" in line:
                self.url = words[words.index("on") + 1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _up_help() -> str:
    return subprocess.run([sys.executable, "-m", "llm_runner_svc", "up", "--help"],
                          capture_output=True, text=True, check=True).stdout


def served_model(url: str) -> str:
    """The first model GET /v1/models lists."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return str(json.load(resp)["data"][0]["id"])


# ---- the load generator --------------------------------------------------------------------

def run_tool(args: argparse.Namespace, url: str, model: str, tokenizer: str, hub: Path,
             point: Point, out: Path) -> dict[str, Any]:
    """One AIPerf profile of `point`; its JSON summary."""
    num_requests = (args.requests or max(32, 4 * point.concurrency) if point.concurrency
                    else max(16, round(point.rate * args.rate_duration_s)))
    # A plain concurrency run polls for a free slot without sleeping (a core's worth of CPU,
    # taken from the deployment's); a rate cap far above the reachable one makes it sleep
    # between tries instead.
    load = (["--concurrency", str(point.concurrency), "--request-rate",
             f"{args.concurrency_rate_cap:g}", "--arrival-pattern", "constant"]
            if point.concurrency
            else ["--request-rate", f"{point.rate:g}", "--arrival-pattern", "poisson"])
    cmd = [args.tool_python, "-m", "aiperf", "profile", "--model", model,
           "--tokenizer", tokenizer, "--url", url, "--endpoint-type", args.endpoint,
           "--streaming", "--isl", str(args.isl), "--isl-stddev", "0",
           "--osl", str(args.osl), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--use-server-token-count", "--request-count", str(num_requests),
           "--warmup-request-count", str(max(1, min(point.concurrency or 4, 16))),
           "--random-seed", str(args.seed), "--artifact-dir", str(out), "--ui", "none",
           "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", str(args.tool_workers),
           "--record-processors", "1", "--goodput",
           f"time_to_first_token:{args.slo_ttft_ms:g} inter_token_latency:{args.slo_itl_ms:g}",
           *load]
    env = os.environ | {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out.mkdir(parents=True, exist_ok=True)
    before, t0 = os.times(), time.perf_counter()
    with open(out / "tool.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=args.point_timeout_s, check=False)
    after = os.times()
    tool_cpu_s = (after.children_user + after.children_system
                  - before.children_user - before.children_system)
    export = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.is_file():
        tail = (out / "tool.log").read_text()[-3000:]
        raise ToolError(f"aiperf exited {done.returncode} at {point.label}:\n{tail}")
    summary: dict[str, Any] = json.loads(export.read_text())
    summary[TOOL_CORES] = tool_cpu_s / (time.perf_counter() - t0)
    return summary


def row_of(summary: dict[str, Any]) -> dict[str, float]:
    """The table's figures from AIPerf's JSON summary (times in ms)."""

    def stat(name: str, key: str = "avg") -> float:
        metric = summary.get(name)
        if not isinstance(metric, dict) or metric.get(key) is None:
            raise ToolError(f"the export has no {name}.{key}")
        return float(metric[key])

    errors = sum(int(e.get("count", 1)) for e in summary.get("error_summary") or [])
    return {"requests": stat("request_count"), "errors": float(errors),
            "ttft_p50": stat("time_to_first_token", "p50"),
            "ttft_p99": stat("time_to_first_token", "p99"),
            "itl_p50": stat("inter_token_latency", "p50"),
            "itl_p99": stat("inter_token_latency", "p99"),
            "tokens_per_s": stat("output_token_throughput"),
            "osl": stat("output_sequence_length"),
            "goodput": stat("goodput") if "goodput" in summary else 0.0,
            "good_share": (stat("good_request_fraction")
                           if "good_request_fraction" in summary else 0.0),
            "tool_cores": float(summary.get(TOOL_CORES, 0.0))}


def sent_requests(out: Path, osl: int) -> list[pb.GenerationRequest]:
    """The requests AIPerf sent (its inputs.json), as Generate requests."""
    reqs = []
    for entry in json.loads((out / "inputs.json").read_text())["data"]:
        for payload in entry["payloads"]:
            max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or osl
            common: dict[str, Any] = {"ignore_eos": True,
                                      "sampling": pb.SamplingOverrides(max_tokens=max_tokens)}
            if "messages" in payload:
                msgs = [pb.ChatMessage(role=m["role"], content=m["content"])
                        for m in payload["messages"]]
                reqs.append(pb.GenerationRequest(messages=pb.ChatMessages(messages=msgs),
                                                 **common))
            else:
                reqs.append(pb.GenerationRequest(text=payload["prompt"], **common))
    return reqs


# ---- Generate directly ---------------------------------------------------------------------

async def generate_tokens_per_s(target: str, reqs: list[pb.GenerationRequest], concurrency: int,
                                num_requests: int) -> float:
    """Output tokens/s of `num_requests` of `reqs` (cycled) sent by `concurrency` asyncio
    clients, each starting its next request when its last one ends."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        todo = iter(range(num_requests))
        num_tokens = 0

        async def client() -> None:
            nonlocal num_tokens
            for i in todo:
                req = opb.GenerateRequest(request=reqs[i % len(reqs)])
                async for ev in stub.Generate(req):
                    if ev.HasField("delta"):
                        num_tokens += len(ev.delta.token_ids)

        for req in reqs[:min(concurrency, 8)]:  # warm, as the tool does
            async for _ in stub.Generate(opb.GenerateRequest(request=req)):
                pass
        t0 = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(concurrency)])
        return num_tokens / (time.perf_counter() - t0)


# ---- the machine's other load --------------------------------------------------------------

def _cpu_s(stat: str) -> float:
    """User + system CPU seconds of a /proc/PID/stat line, its reaped children's included."""
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _ours_s() -> float:
    """CPU seconds of this process and every live descendant (each with reaped children)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # it exited meanwhile
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cpu[int(entry.name)] = _cpu_s(stat)
    me, total = os.getpid(), 0.0
    for pid, seconds in cpu.items():
        p = pid
        while p not in (0, 1, me) and p in parent:
            p = parent[p]
        if p == me:
            total += seconds
    return total


def _busy_s() -> float:
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """The share of the cores that processes outside this benchmark took between `start()`
    and `share()`."""

    def start(self) -> None:
        self._mark = (time.perf_counter(), _busy_s(), _ours_s())

    def share(self) -> float:
        t0, busy0, ours0 = self._mark
        t1, busy1, ours1 = time.perf_counter(), _busy_s(), _ours_s()
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / ((t1 - t0) * (os.cpu_count() or 1))

    def wait_quiet(self, limit: float, timeout_s: float) -> None:
        """Returns after a second in which other processes took at most `limit` of the
        cores, or after `timeout_s` (the point then runs as loaded as the machine is)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.start()
            time.sleep(1.0)
            if self.share() <= limit:
                return


# ---- the sweep -----------------------------------------------------------------------------

def sweep(args: argparse.Namespace, url: str, orchestrator: str | None, work: Path
          ) -> list[tuple[Point, dict[str, float]]]:
    hub = work / "hub"
    tokenizer = create_hub_entry(None if args.model == "stories260K" else args.model, hub)
    model = args.served_model or served_model(url)
    points = [Point(concurrency=int(c)) for c in args.concurrency.split(",") if c]
    points += [Point(rate=float(r)) for r in args.rates.split(",") if r]
    other = OtherLoad()
    rows = []
    for i, point in enumerate(points):
        out = work / f"point{i}"
        other.wait_quiet(args.quiet, args.quiet_wait_s)
        other.start()
        row = row_of(run_tool(args, url, model, tokenizer, hub, point, out))
        row["other_load"] = other.share()
        if point.concurrency and orchestrator:
            other.wait_quiet(args.quiet, args.quiet_wait_s)
            other.start()
            row["generate_tokens_per_s"] = asyncio.run(generate_tokens_per_s(
                orchestrator, sent_requests(out, args.osl), point.concurrency,
                int(row["requests"])))
            row["other_load"] = max(row["other_load"], other.share())
        rows.append((point, row))
        print(f"# {point.label}: {row['tokens_per_s']:.1f} tokens/s through the gateway",
              file=sys.stderr, flush=True)
    return rows


def table(rows: list[tuple[Point, dict[str, float]]]) -> str:
    lines = ["| load | requests (errors) | TTFT p50 / p99 ms | ITL p50 / p99 ms "
             "| output tokens/s | goodput req/s (share) | Generate tokens/s "
             "| gateway / Generate | load generator cores | other load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for point, r in rows:
        direct = r.get("generate_tokens_per_s")
        ratio = "-" if direct is None else f"{r['tokens_per_s'] / direct:.2f}"
        lines.append(
            f"| {point.label} | {r['requests']:.0f} ({r['errors']:.0f}) "
            f"| {r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} "
            f"| {r['itl_p50']:.2f} / {r['itl_p99']:.2f} | {r['tokens_per_s']:.1f} "
            f"| {r['goodput']:.2f} ({100 * r['good_share']:.0f}%) "
            f"| {'-' if direct is None else f'{direct:.1f}'} "
            f"| {ratio} | {r['tool_cores']:.2f} | {100 * r['other_load']:.0f}% |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool-python", default=sys.executable,
                    help="the python of a venv with aiperf installed")
    ap.add_argument("--url", default=None, help="a running gateway (default: start one)")
    ap.add_argument("--orchestrator", default=None,
                    help="with --url: its orchestrator HOST:PORT, for the Generate column")
    ap.add_argument("--served-model", default=None,
                    help="the API's model id (default: the first of GET /v1/models)")
    ap.add_argument("--model", default="stories260K",
                    help="the stage's artifact; its tokenizer is the tool's")
    ap.add_argument("--engine", default="numpy", help="the stage's engine (numpy, synthetic, "
                    "torch, onnx, ...)")
    ap.add_argument("--synthetic-step-ms", type=float, default=20.0,
                    help="the synthetic engine's time per step")
    ap.add_argument("--workers", type=int, default=None,
                    help="orchestrator and gateway worker processes (llm-runner up --workers)")
    ap.add_argument("--max-batch", type=int, default=64, help="the stage's maxBatch")
    ap.add_argument("--max-seq", type=int, default=256, help="the stage's maxSeq")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--rates", default="", help="request rates (req/s), e.g. 10,20,40")
    ap.add_argument("--rate-duration-s", type=float, default=10.0,
                    help="a rate point sends rate x this many requests (at least 16)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per concurrency point (default 4 x concurrency, >= 32)")
    ap.add_argument("--isl", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--osl", type=int, default=32, help="output tokens per request")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--concurrency-rate-cap", type=float, default=500.0,
                    help="a concurrency point's request rate cap (req/s), far above the "
                         "reachable rate: the tool then waits for a free slot asleep")
    ap.add_argument("--seed", type=int, default=1, help="the tool's prompts")
    ap.add_argument("--tool-workers", type=int, default=2,
                    help="the tool's request-sending worker processes")
    ap.add_argument("--point-timeout-s", type=float, default=600.0)
    ap.add_argument("--quiet", type=float, default=0.15,
                    help="each run waits for a second in which other processes took at most "
                         "this share of the cores ...")
    ap.add_argument("--quiet-wait-s", type=float, default=60.0, help="... for this long at most")
    ap.add_argument("--keep", default=None, help="keep the tool's artifacts in this directory")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, model {args.model}, engine "
          f"{args.engine}, prompt {args.isl} / output {args.osl} tokens, endpoint "
          f"{args.endpoint}, SLO TTFT {args.slo_ttft_ms:g} ms ITL {args.slo_itl_ms:g} ms, "
          f"aiperf {TOOL_VERSION}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        up = None
        try:
            if args.url is None:
                up = Up(Path(tmp), args)
            url = args.url or (up.url if up else "")
            orchestrator = args.orchestrator or (up.orchestrator if up else None)
            rows = sweep(args, url, orchestrator, work)
        except (ToolError, DeploymentError) as exc:
            print(f"bench_serving: {exc}", file=sys.stderr)
            return 2
        finally:
            if up is not None:
                up.close()
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    print(table(rows))
    return 1 if any(r["errors"] for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
