"""Time to first token of the torch engine, and how long running decodes stall while a long
prompt joins, against Hugging Face's forward and the compute floor.

For each model shape (random weights at the real shape, drawn once into a transformers
`Qwen2ForCausalLM` and shared with our engine, as in bench_gpu.py):
  - ttft: one request alone, from `submit` until the runtime step that yields its first
    token returns (prefill + first token, however many steps the runtime takes), best of
    `--reps` after one warm-up;
  - hf: transformers' forward of the same prompt (`logits_to_keep=1`, so only the last
    position's logits, as `generate` asks for), best of `--reps` after one warm-up;
  - floor: the prompt's FLOPs (every linear product for every token, causal attention, the
    head for the last token) at the bf16 matrix-product rate measured at the start of the
    run (an 8192^3 product);
  - stall: `--stall-batch` requests decoding, then one `--stall-prompt`-token prompt joins
    (after one such prompt has joined and left, to warm up): the median decode step before
    it, the longest and the median step until its first token, and its TTFT
    (on a runtime of its own for each of `--stall-chunks`: prompt tokens per forward or per
    step; 0 = the runtime's default).
`--smoke` runs a tiny shape on the CPU (float32) to check the script without a GPU.

Usage: python benchmarks/bench_prefill.py [--shapes qwen2.5-1.5b,qwen2.5-7b]
       [--prompts 512,2048,8192] [--reps 3] [--chunk 8192] [--stall-batch 32]
       [--stall-prompt 4096] [--stall-chunks 0,512] [--no-hf] [--json FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402
from bench_gpu import hf_model, shared_weights  # noqa: E402

from llm_runner_svc.engines.torch_engine import PREFILL_GRAPH_TOKENS, TorchEngine  # noqa: E402
from llm_runner_svc.engines.torch_weights import named_shape  # noqa: E402
from llm_runner_svc.models.spec import ModelConfig, RopeStyle  # noqa: E402
from llm_runner_svc.runtime import (  # noqa: E402
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    resolve,
)

TINY = ModelConfig(
    arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096, rope_theta=1e6,
    rope_style=RopeStyle.HALF, rms_eps=1e-6, has_qkv_bias=True, tie_embeddings=True,
    eos_ids=(0,))


def matmul_rate(device: str) -> float:
    """FLOP/s of a large product in the engine's dtype (bf16 on the GPU, float32 on the CPU)."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device == "cuda":
        ms = gpu_paths.event_ms(lambda: a @ b, reps=10, warmup=3)
    else:
        a @ b
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        ms = (time.perf_counter() - t0) * 100
    return 2 * n ** 3 / (ms / 1000)


def prefill_flops(c: ModelConfig, n: int) -> float:
    """Linear products of n tokens, causal attention (q.k and p.v over n(n+1)/2 pairs per
    head), the head for the last token."""
    per_layer = (c.hidden_size * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    attention = 4 * c.head_dim * c.num_heads * n * (n + 1) / 2
    return c.num_layers * (2 * n * per_layer + attention) + 2 * c.vocab_size * c.hidden_size


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_forward_s(model: torch.nn.Module, prompt: list[int], reps: int, device: str) -> float:
    ids = torch.tensor([prompt], device=device)
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            sync(device)
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            sync(device)
            times.append(time.perf_counter() - t0)
    return min(times[1:])


def _request(rt: InferenceRuntime, rid: str, prompt: list[int], max_new: int
             ) -> GenerationRequest:
    return GenerationRequest(rid, prompt, resolve(rt.config.sampling, temperature=0.0,
                                                  max_new_tokens=max_new), ignore_eos=True)


def until_first_token(rt: InferenceRuntime, rid: str, step_s: list[float]) -> float:
    """Step until request `rid` gets a token; each step's seconds go to `step_s`; returns
    the seconds from now to then."""
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        events = rt.step()
        step_s.append(time.perf_counter() - t)
        if any(ev.request_id == rid and ev.token_ids for ev in events):
            return time.perf_counter() - t0


def ttft_s(rt: InferenceRuntime, prompt: list[int], reps: int, tag: str) -> float:
    times = []
    for i in range(reps + 1):
        rid = f"{tag}-{i}"
        rt.submit(_request(rt, rid, prompt, 1))
        times.append(until_first_token(rt, rid, []))
        while rt.has_work:
            rt.step()
    return min(times[1:])


def stall(rt: InferenceRuntime, vocab: int, batch: int, prompt_len: int,
          profile: bool = False) -> dict:
    """`batch` requests decoding, then a `prompt_len` prompt joins; twice, the first time
    to warm up what a joining prompt's steps use first (product shapes, kernel modules)."""
    gen = torch.Generator().manual_seed(2)
    own = min(128, rt.max_seq // 8)  # each decoding request's prompt
    for i in range(batch):
        ids = torch.randint(0, vocab, (own,), generator=gen).tolist()
        rt.submit(_request(rt, f"d{i}", ids, rt.max_seq - own))
    started: set[str] = set()
    while len(started) < batch:  # every request prefilled and decoding
        started |= {ev.request_id for ev in rt.step() if ev.token_ids}
    long_prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    rt.submit(_request(rt, "warm-up", long_prompt, 1))
    until_first_token(rt, "warm-up", [])
    before: list[float] = []
    for _ in range(30):
        t = time.perf_counter()
        rt.step()
        before.append(time.perf_counter() - t)
    joining: list[float] = []
    calls = _CallTimes(rt.engine, profile)
    rt.submit(_request(rt, "joiner", long_prompt[::-1], 8))
    first = until_first_token(rt, "joiner", joining)
    calls.stop()
    calls.print_slowest()
    for i in range(batch):
        rt.cancel(f"d{i}")
    while rt.has_work:
        rt.step()
    return {"decode_step_ms": 1000 * statistics.median(before),
            "longest_step_ms": 1000 * max(joining),
            "median_joining_step_ms": 1000 * statistics.median(joining),
            "steps_to_first_token": len(joining), "joiner_ttft_ms": 1000 * first,
            "joining_steps_ms": [round(1000 * t, 2) for t in joining],
            "launch_ms": calls.ms("launch"), "read_ms": calls.ms("read")}


class _CallTimes:
    """Seconds the host spends in the engine's `launch` and `read`, call by call."""

    def __init__(self, engine: TorchEngine, profile: bool = False) -> None:
        self.engine, self.times = engine, {"launch": [], "read": []}
        self.profile, self.slowest = profile, {}
        for name in self.times:
            setattr(engine, name, self._timed(name, getattr(engine, name)))

    def _timed(self, name: str, call):  # noqa: ANN001, ANN202
        def timed(arg):  # noqa: ANN001, ANN202
            prof = cProfile.Profile() if self.profile else None
            t = time.perf_counter()
            out = prof.runcall(call, arg) if prof else call(arg)
            took = time.perf_counter() - t
            if prof and took > max(self.times[name], default=0.0):
                self.slowest[name] = prof
            self.times[name].append(took)
            return out
        return timed

    def print_slowest(self) -> None:
        """Where the host spent the slowest launch and read (cProfile, cumulative)."""
        for name, prof in self.slowest.items():
            print(f"# slowest {name}:")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    def stop(self) -> None:
        for name in self.times:
            delattr(self.engine, name)

    def ms(self, name: str) -> list[float]:
        return [round(1000 * t, 2) for t in self.times[name]]


def runtime(engine: TorchEngine, max_batch: int, max_seq: int, chunk: int | None
            ) -> InferenceRuntime:
    """A preallocated runtime over `engine`; `chunk` (None: the runtime's default) goes to
    whichever knob of prompt tokens per forward or per step this build has."""
    names = {f.name for f in dataclasses.fields(RuntimeConfig)}
    extra = {k: chunk for k in ("prefill_chunk", "max_tokens_per_step")
             if k in names and chunk is not None}
    rt = InferenceRuntime(engine, gpu_paths.IdTokenizer(engine.config.vocab_size),
                          RuntimeConfig(max_batch=max_batch, max_seq=max_seq, **extra))
    t0 = time.perf_counter()
    rt.preallocate()
    print(f"# preallocate and capture {time.perf_counter() - t0:.1f} s, {extra}", flush=True)
    return rt


def bench_shape(name: str, config: ModelConfig, args: argparse.Namespace, rate: float
                ) -> list[dict]:
    device = "cpu" if args.smoke else "cuda"
    print(f"# {name}", flush=True)
    hf = hf_model(config, device, torch.float32 if args.smoke else torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
               for n in args.prompts}
    hf_s = {} if args.no_hf else {n: hf_forward_s(hf, p, args.reps, device)
                                  for n, p in prompts.items()}
    engine = TorchEngine(config, shared_weights(hf, config), device=device,
                         mixed_steps=args.mixed_steps,
                         prefill_graph_tokens=args.prefill_graph_tokens)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    max_seq = max(max(args.prompts), args.stall_prompt) + 64
    rt = runtime(engine, 1, max_seq, args.chunk)
    rows = []
    for n, prompt in prompts.items():
        flops = prefill_flops(config, n)
        row = {"shape": name, "prompt": n, "ttft_ms": 1000 * ttft_s(rt, prompt, args.reps, "t"),
               "hf_ms": 1000 * hf_s[n] if n in hf_s else None, "flops": flops,
               "floor_ms": 1000 * flops / rate}
        print(json.dumps(row), flush=True)
        rows.append(row)
    rt.close()
    if args.ttft_default:  # the same prompts under the runtime's default tokens per step
        rt = runtime(engine, 1, max_seq, None)
        for row in rows:
            row["default_ttft_ms"] = 1000 * ttft_s(rt, prompts[row["prompt"]], args.reps, "d")
            print(json.dumps({k: row[k] for k in ("shape", "prompt", "default_ttft_ms")}),
                  flush=True)
        rt.close()
    for chunk in args.stall_chunks:
        rt = runtime(engine, args.stall_batch + 1, max_seq, chunk or None)
        st = {"shape": name, "stall_batch": args.stall_batch,
              "stall_prompt": args.stall_prompt, "stall_chunk": chunk,
              **stall(rt, config.vocab_size, args.stall_batch, args.stall_prompt,
                      args.profile)}
        print(json.dumps(st), flush=True)
        rows.append(st)
        rt.close()
    del engine, rt
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_tables(rows: list[dict]) -> None:
    print("| shape | prompt | TTFT ms | HF forward ms | TTFT / HF | floor ms | floor / TTFT |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "prompt" in r:
            hf = r["hf_ms"]
            hf_cells = f"{hf:.1f} | {r['ttft_ms'] / hf:.2f}" if hf else "- | -"
            default = f" (default tokens per step: {r['default_ttft_ms']:.1f})" \
                if "default_ttft_ms" in r else ""
            print(f"| {r['shape']} | {r['prompt']:,} | {r['ttft_ms']:.1f}{default} | "
                  f"{hf_cells} | {r['floor_ms']:.1f} | {r['floor_ms'] / r['ttft_ms']:.0%} |")
    print("| shape | decoding | joining prompt | tokens per step | decode step ms | longest "
          "step ms | median joining step ms | steps to its first token | its TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "stall_batch" in r:
            print(f"| {r['shape']} | {r['stall_batch']} | {r['stall_prompt']:,} | "
                  f"{r['stall_chunk'] or 'default'} | "
                  f"{r['decode_step_ms']:.2f} | {r['longest_step_ms']:.1f} | "
                  f"{r['median_joining_step_ms']:.1f} | {r['steps_to_first_token']} | "
                  f"{r['joiner_ttft_ms']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192,
                    help="prompt tokens per forward (prefill_chunk) or per step")
    ap.add_argument("--stall-batch", type=int, default=32)
    ap.add_argument("--stall-prompt", type=int, default=4096)
    ap.add_argument("--stall-chunks", default="0",
                    help="for each, a stall runtime with this many prompt tokens per forward "
                         "or per step (0: the runtime's default)")
    ap.add_argument("--ttft-default", action="store_true",
                    help="also the TTFT of each prompt with the default tokens per step")
    ap.add_argument("--mixed-steps", default="split", choices=("split", "joined"),
                    help="the torch engine's way of running a step with decodes and chunks")
    ap.add_argument("--prefill-graph-tokens", type=int, default=PREFILL_GRAPH_TOKENS,
                    help="prefill passes up to this many tokens replay CUDA graphs (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="print where the host spent the slowest launch and read of a stall")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.reps, args.chunk = "16,64", 1, 64
        args.stall_batch, args.stall_prompt, args.stall_chunks = 4, 64, "0,16"
    args.prompts = [int(n) for n in args.prompts.split(",")]
    args.stall_chunks = [int(n) for n in args.stall_chunks.split(",")]
    device = "cpu" if args.smoke else "cuda"
    rate = matmul_rate(device)
    what = "tiny, CPU" if args.smoke else torch.cuda.get_device_name()
    print(f"# {what}, torch {torch.__version__}, matmul {rate / 1e12:.1f} TFLOP/s", flush=True)
    shapes = [("tiny", TINY)] if args.smoke else [(s, named_shape(s))
                                                  for s in args.shapes.split(",")]
    rows = [r for name, config in shapes for r in bench_shape(name, config, args, rate)]
    print_tables(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": what, "torch": torch.__version__,
                                               "matmul_flops": rate, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
