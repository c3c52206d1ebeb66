"""The measured paths of bench_gpu.py, each returning the median decode-step time (seconds)
of a batch that decodes together: the runtime in-process, our runner's Stage service over a
loopback port (one Step stream, every member joined), the orchestrator in front of it, and
Hugging Face `generate` on the same weights.

The gRPC clients run in child processes (`client_process`), as real callers do, so the
client's own decoding does not share the serving process's interpreter and event loop:
`python gpu_paths.py grpc_direct|grpc_orchestrator TARGET STEPS` with the prompts as JSON on
stdin prints the step times it measured (one for the Step stream's median gap, one per request
through the orchestrator). Orchestrator callers are spread over several processes: one Python
process reads a few tens of thousands of messages a second, fewer than 64 requests of a small
model receive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import torch

from llm_runner_svc.models import Model
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, resolve
from llm_runner_svc.server import stop_stage_server
from llm_runner_svc.servicer import SERVICE_NAME, StageServicer
from llm_runner_svc.stage import LlmStage, StageConfig
from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc, stage_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.server import ServerOptions, create_server


class IdTokenizer(Tokenizer):
    """Random-weight models have no vocabulary: each id prints as one character."""

    def __init__(self, vocab_size: int) -> None:
        self.bos_id = None
        self.eos_ids = ()
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [ord(ch) % self.vocab_size for ch in text]

    def decode(self, ids: Sequence[int], after_bos: bool = False) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


def event_ms(run: Callable[[], object], reps: int, rounds: int = 1, warmup: int = 0) -> float:
    """Milliseconds per call of `run` (GPU work it queues, timed between CUDA events): `reps`
    calls back to back per round, the median round of `rounds`, after `warmup` calls."""
    for _ in range(warmup):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def graph_us(run: Callable[[], object], reps: int = 50) -> float:
    """Microseconds per call of `run` on the device alone: `reps` calls captured as one
    CUDA graph (after one call outside it, which compiles what it launches), the graph's
    median of 5 replays. Kernels of a few microseconds launched eagerly from Python are
    timed by the host's launch rate instead; in a graph, as the engine runs them, they are
    not."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            run()
    return 1000 * event_ms(graph.replay, reps=1, rounds=5, warmup=1) / reps


@contextlib.asynccontextmanager
async def stage_server(config: StageConfig, model: Model, rt: InferenceRuntime
                       ) -> AsyncIterator[str]:
    """Our runner's Stage service over `rt` on a loopback port in this process; yields its
    address and stops it on the way out."""
    stage = LlmStage(config, model, rt)
    await stage.start()
    handle = await create_server(ServerOptions(port=0), [(
        stage_pb2_grpc.add_StageServicer_to_server, StageServicer(stage), SERVICE_NAME)])
    try:
        yield f"127.0.0.1:{handle.port}"
    finally:
        await stop_stage_server(handle, stage)


@contextlib.asynccontextmanager
async def orchestrator_process(stage_target: str, workers: int = 1) -> AsyncIterator[str]:
    """`python -m services.orchestrator --workers N` in its own process(es), as deployed, over
    the one stage at `stage_target`; yields its address and stops it on the way out."""
    with tempfile.TemporaryDirectory() as tmp:
        topology = Path(tmp) / "topology.json"
        topology.write_text(json.dumps({
            "stages": [{"id": "backbone", "runner": "llm.backbone", "endpoints": [stage_target],
                        "emits": ["text", "tokens"], "inputs": ["request:prompt"]}],
            "sinks": ["backbone:text"], "defaultSinks": ["backbone:text"]}))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.orchestrator", "--topology", str(topology),
            "--port", "0", *(["--workers", str(workers)] if workers > 1 else []),
            stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            line = (await proc.stdout.readline()).decode()
            found = re.search(r"listening on (\S+:\d+)", line)
            if found is None:
                raise RuntimeError(f"the orchestrator did not start: {line!r}")
            yield found.group(1)
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()


def in_process(rt: InferenceRuntime, prompts: list[list[int]], steps: int) -> float:
    for i, ids in enumerate(prompts):
        rt.submit(GenerationRequest(f"p{i}", ids, resolve(
            rt.config.sampling, temperature=0.0, max_new_tokens=steps), ignore_eos=True))
    times = []
    rt.step()  # every request joins and prefills here; later steps only decode
    while rt.has_work:
        t0 = time.perf_counter()
        rt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def grpc_direct(target: str, prompts: list[list[int]], steps: int) -> list[float]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = stage_pb2_grpc.StageStub(ch)
        slots = list(range(1, len(prompts) + 1))
        for slot, ids in zip(slots, prompts, strict=True):
            req = pb.GenerationRequest(ignore_eos=True, sampling=pb.SamplingOverrides(
                temperature=0.0, max_tokens=steps))
            req.token_ids.ids.extend(ids)
            assert (await stub.Admit(pb.AdmitRequest(slot_id=slot, request=req))).admitted
            await stub.Prepare(pb.PrepareRequest(slot_id=slot))
        q: asyncio.Queue[pb.StepRequest | None] = asyncio.Queue()
        q.put_nowait(pb.StepRequest(join=slots, credits=64))

        async def requests():
            while (m := await q.get()) is not None:
                yield m

        stamps, ended = [], 0
        async for ev in stub.Step(requests()):
            q.put_nowait(pb.StepRequest(credits=1))
            if sum(1 for m in ev.members if m.token_ids) == len(slots):
                stamps.append(time.perf_counter())
            ended += sum(1 for m in ev.members if m.status == pb.MEMBER_STATUS_ENDED)
            if ended == len(slots):
                q.put_nowait(None)
        for slot in slots:
            await stub.Finish(pb.FinishRequest(slot_id=slot))
            await stub.Reset(pb.ResetRequest(slot_id=slot))
    return [statistics.median(_gaps(stamps))]


async def grpc_orchestrator(target: str, prompts: list[list[int]], steps: int) -> list[float]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)

        async def one(ids: list[int]) -> float:
            req = pb.GenerationRequest(ignore_eos=True, sampling=pb.SamplingOverrides(
                temperature=0.0, max_tokens=steps))
            req.token_ids.ids.extend(ids)
            stamps: list[tuple[float, int]] = []  # (arrival, tokens) of each delta
            async for ev in stub.Generate(opb.GenerateRequest(request=req)):
                if ev.HasField("delta"):
                    stamps.append((time.perf_counter(), len(ev.delta.token_ids)))
            # A caller that lags gets several tokens in one delta: time per token after the
            # first delta, not the gap between deltas.
            return (stamps[-1][0] - stamps[0][0]) / sum(n for _, n in stamps[1:])

        return list(await asyncio.gather(*[one(ids) for ids in prompts]))


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> float:
    """Per-step time of `generate` (greedy, its default cache) from the difference between
    producing steps + 1 tokens and 1 token, so prefill is left out."""
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)
    return (run(steps + 1) - run(1)) / steps


def random_model(name: str, config, weights) -> Model:
    return Model(name=name, format="random", config=config, weights=weights,
                 tokenizer=IdTokenizer(config.vocab_size))


async def client_process(path: str, target: str, prompts: list[list[int]], steps: int,
                         num_procs: int = 1) -> float:
    """Run the gRPC client `path` in `num_procs` child processes, the prompts dealt among
    them; the median of the step times they measured (seconds)."""
    shares = [prompts[i::num_procs] for i in range(num_procs)]
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, __file__, path, target, str(steps), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE) for share in shares if share]
    outs = await asyncio.gather(*(proc.communicate(json.dumps(share).encode())
                                  for proc, share in zip(procs, shares, strict=False)))
    times: list[float] = []
    for proc, (out, _) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"{path} client exited with {proc.returncode}")
        times.extend(json.loads(out.decode().splitlines()[-1]))
    return statistics.median(times)


if __name__ == "__main__":
    _path, _target, _steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _client = {"grpc_direct": grpc_direct, "grpc_orchestrator": grpc_orchestrator}[_path]
    print(json.dumps(asyncio.run(_client(_target, json.load(sys.stdin), _steps))))
