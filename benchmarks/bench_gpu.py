"""Decode speed of the torch engine on one GPU, in one process, against its baselines (the
gRPC clients alone run in a child process, as a caller would).

For each model shape (random bf16 weights at the real shape, drawn once and shared by every
path) and each batch size, the median time of one decode step, measured five ways:
  - floor: the weights read once at the copy bandwidth measured at the start of this run;
  - graph: the captured decode step alone (CUDA events around graph replays);
  - in-process: `InferenceRuntime.step()` over the torch engine (what the service drives);
  - grpc: our runner's Stage service on a loopback port, one Step stream with every member;
  - orchestrator: Orchestrator.Generate in its own process (as deployed) in front of that
    runner, one call per request, the callers spread over --client-procs processes, once for
    each count of --orchestrator-workers (`--workers N`: N processes on one port; the first
    count is the table's column) (`--inline-orchestrator`: on the runner's event loop);
  - hf: Hugging Face `generate` (greedy, its default cache) on the same weights.
Every request has a `--prompt`-token prompt and generates `--steps` tokens (greedy,
ignore_eos). Prints one table with ratios and writes every figure as JSON.

Usage: python benchmarks/bench_gpu.py [--shapes qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b]
       [--batches 1,8,32,64] [--prompt 128] [--steps 128] [--hf-steps 32] [--json FILE]
       [--orchestrator-workers 1,2,4] [--client-procs 4] [--inline-orchestrator]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.base import DecodeRow  # noqa: E402
from llm_runner_svc.engines.torch_engine import TorchEngine  # noqa: E402
from llm_runner_svc.engines.torch_weights import named_shape  # noqa: E402
from llm_runner_svc.models.spec import LayerWeights, ModelConfig, ModelWeights  # noqa: E402
from llm_runner_svc.runtime import InferenceRuntime, RuntimeConfig  # noqa: E402
from llm_runner_svc.stage import StageConfig  # noqa: E402
from services.orchestrator.service import create_orchestrator_server  # noqa: E402
from services.orchestrator.topology import single_stage  # noqa: E402
from services.server import ServerOptions  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.nbytes / (start.elapsed_time(end) / 1000)


def hf_model(config: ModelConfig, device: str = "cuda",
             dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A transformers Qwen2 model of `config`'s shape, random weights (bf16 on the GPU by
    default)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hcfg = Qwen2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_eps, tie_word_embeddings=config.tie_embeddings)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(hcfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def shared_weights(model: torch.nn.Module, config: ModelConfig) -> ModelWeights:
    """The HF model's tensors in the loaders' layout (the engine fuses its own copies)."""
    sd = dict(model.named_parameters())
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            attn_norm=sd[p + "input_layernorm.weight"], wq=sd[a + "q_proj.weight"],
            wk=sd[a + "k_proj.weight"], wv=sd[a + "v_proj.weight"], wo=sd[a + "o_proj.weight"],
            ffn_norm=sd[p + "post_attention_layernorm.weight"], w_gate=sd[m + "gate_proj.weight"],
            w_up=sd[m + "up_proj.weight"], w_down=sd[m + "down_proj.weight"],
            bq=sd[a + "q_proj.bias"], bk=sd[a + "k_proj.bias"], bv=sd[a + "v_proj.bias"]))
    head = None if config.tie_embeddings else sd["lm_head.weight"]
    return ModelWeights(embedding=sd["model.embed_tokens.weight"], layers=layers,
                        final_norm=sd["model.norm.weight"], lm_head=head)


def graph_step_ms(engine: TorchEngine, batch: int, position: int) -> float:
    """Replays of the captured step for `batch` rows, each at `position` on pages of its
    own (inputs staged here: a runtime may have left the buffer staged for another batch
    size, whose packed layout a replay would misread)."""
    graphs = engine.graphs
    assert graphs is not None
    bucket = graphs.bucket_for(batch)
    plan = engine._need_plan()
    per_row = position // plan.page_size + 1
    rows = [DecodeRow(0, position, [(i * per_row + p) % plan.num_pages for p in range(per_row)])
            for i in range(batch)]
    engine.stager.stage(rows, bucket)
    return gpu_paths.event_ms(lambda: graphs.replay(bucket), reps=100, warmup=5)


async def served(engine: TorchEngine, model, rt_config: RuntimeConfig, batches: list[int],
                 prompts: dict[int, list[list[int]]], steps: int,
                 args: argparse.Namespace) -> dict[int, dict]:
    """The runner's Stage service on a loopback port in this process and the orchestrator in
    front of it in its own process, as deployed (`inline_orchestrator`: in this process, on
    the runner's event loop); each client in a child process."""
    config = StageConfig(stage_id="backbone", engine="torch", max_batch=rt_config.max_batch,
                         max_seq=rt_config.max_seq)
    rt = InferenceRuntime(engine, model.tokenizer, rt_config)
    out: dict[int, dict] = {b: {"orchestrator_ms_by_workers": {}} for b in batches}
    async with gpu_paths.stage_server(config, model, rt) as target:
        for b in batches:
            direct = await gpu_paths.client_process("grpc_direct", target, prompts[b], steps)
            out[b]["grpc_ms"] = 1000 * direct
        for i, workers in enumerate(args.orchestrator_workers):
            async with orchestrator(target, args.inline_orchestrator, workers) as orch_target:
                for b in batches:
                    via = 1000 * await gpu_paths.client_process(
                        "grpc_orchestrator", orch_target, prompts[b], steps,
                        min(args.client_procs, b))
                    out[b]["orchestrator_ms_by_workers"][workers] = via
                    if i == 0:
                        out[b]["orchestrator_ms"] = via
    return out


@contextlib.asynccontextmanager
async def orchestrator(stage_target: str, inline: bool, workers: int = 1) -> AsyncIterator[str]:
    if not inline:
        async with gpu_paths.orchestrator_process(stage_target, workers) as target:
            yield target
        return
    handle, orch = await create_orchestrator_server(single_stage([stage_target]),
                                                    ServerOptions(port=0))
    try:
        yield f"127.0.0.1:{handle.port}"
    finally:
        await handle.server.stop(0)
        await orch.close()


def bench_shape(name: str, args: argparse.Namespace, bandwidth: float) -> list[dict]:
    config = named_shape(name)
    hf = hf_model(config)
    engine = TorchEngine(config, shared_weights(hf, config), device="cuda")
    max_batch = max(args.batches)
    rt_config = RuntimeConfig(max_batch=max_batch, max_seq=args.prompt + args.steps + 16)
    model = gpu_paths.random_model(name, config, None)
    rt = InferenceRuntime(engine, model.tokenizer, rt_config)
    t0 = time.perf_counter()
    rt.preallocate()
    print(f"# {name}: preallocate and capture {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, config.vocab_size, (b, args.prompt), generator=gen).tolist()
               for b in args.batches}
    floor_ms = 1000 * engine.weights.step_bytes() / bandwidth
    rows = []
    for b in args.batches:
        step = gpu_paths.in_process(rt, prompts[b], args.steps)
        rows.append({"shape": name, "batch": b, "floor_ms": floor_ms,
                     "graph_ms": graph_step_ms(engine, b, args.prompt),
                     "in_process_ms": 1000 * step})
    served_ms = asyncio.run(served(engine, model, rt_config, args.batches, prompts, args.steps,
                                   args))
    for r in rows:
        r.update(served_ms[r["batch"]])
        with torch.no_grad():
            r["hf_ms"] = 1000 * gpu_paths.hf_generate(hf, prompts[r["batch"]], args.hf_steps)
        print(json.dumps(r), flush=True)
    rt.close()
    del engine, hf, rt
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--hf-steps", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--orchestrator-workers", default="1",
                    help="worker counts of the orchestrator, each timed (the first is the "
                         "table's column)")
    ap.add_argument("--client-procs", type=int, default=4,
                    help="processes the orchestrator's callers are spread over")
    ap.add_argument("--inline-orchestrator", action="store_true",
                    help="run the orchestrator on the runner's event loop, not in its own "
                         "process")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.orchestrator_workers = [int(w) for w in args.orchestrator_workers.split(",")]
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"# {gpu}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"prompt {args.prompt}, {args.steps} decode steps", flush=True)
    rows = [r for name in args.shapes.split(",") for r in bench_shape(name, args, bandwidth)]
    workers = args.orchestrator_workers
    print("| shape | batch | floor ms | graph ms | in-process ms | tok/s | gRPC ms | gRPC/in-proc "
          f"| orchestrator ms ({', '.join(f'{w}w' for w in workers)}) | orch/in-proc "
          "| HF ms | HF tok/s | vs HF | floor/in-proc |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b, by_workers = r["batch"], r["orchestrator_ms_by_workers"]
        orch_cols = ", ".join(f"{by_workers[w]:.2f}" for w in workers)
        print(f"| {r['shape']} | {b} | {r['floor_ms']:.2f} | {r['graph_ms']:.2f} | "
              f"{r['in_process_ms']:.2f} | {1000 * b / r['in_process_ms']:,.0f} | "
              f"{r['grpc_ms']:.2f} | {r['in_process_ms'] / r['grpc_ms']:.2f} | "
              f"{orch_cols} | "
              f"{r['in_process_ms'] / r['orchestrator_ms']:.2f} | "
              f"{r['hf_ms']:.1f} | {1000 * b / r['hf_ms']:,.0f} | "
              f"{r['hf_ms'] / r['in_process_ms']:.1f}x | "
              f"{r['floor_ms'] / r['in_process_ms']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "copy_bandwidth_bytes_per_s": bandwidth, "prompt": args.prompt,
            "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
