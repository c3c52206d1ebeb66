"""What structured output costs a decode step: the median `InferenceRuntime.step()` with every
row under a JSON-schema constraint against the same batch decoding freely, in one process.

A constrained row's mask is computed on the host (llguidance, on its thread pool) while the
device runs the step's forward, and the step is read before the next launch (the next mask
needs the pick); this measures what is left of both. A constrained request that ends (its
JSON whole) is replaced at once by a new one, so the batch stays full; the median step is a
decode step. Also printed: the host time to fill the batch's masks alone.

Engines: `--engine torch` on CUDA with random bf16 weights at a named shape (`--shape
qwen2.5-7b`), the grammar built from a tokenizer file (`--tokenizer-json`, the `tokenizers`
serialization; `llm-runner`'s SmolLM2 tokenizer by default when the package is installed), its
masks as wide as the shape's vocabulary; or `--engine numpy` / `torch-cpu` on a real model
(`--model smollm2`, the CPU figure).

Usage: python benchmarks/bench_structured_step.py --engine numpy --model smollm2 --batches 1,8
       python benchmarks/bench_structured_step.py --engine torch --shape qwen2.5-7b \
           --tokenizer-json tok.json --batches 1,8,32
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llm_runner_svc.models import load_model, smollm2_path
from llm_runner_svc.models.hf import HfTokenizer
from llm_runner_svc.models.model import Model
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.runtime.grammar import GrammarMatcher

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                 "maxItems": 6},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "email", "tags", "address", "bio"],
}


def tokenizer_from_json(path: Path) -> Tokenizer:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path))
    eos = tuple(i for i in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
                if i is not None)
    return HfTokenizer(tok, None, eos, False)


def build(args: argparse.Namespace) -> tuple[InferenceRuntime, Tokenizer, int]:
    max_batch = max(int(b) for b in args.batches.split(","))
    rt_config = RuntimeConfig(max_batch=max_batch, max_seq=args.prompt + args.steps + 16)
    if args.engine == "torch":
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_gpu import hf_model, shared_weights

        from llm_runner_svc.engines.torch_engine import TorchEngine
        from llm_runner_svc.engines.torch_weights import named_shape

        config = named_shape(args.shape)
        hf = hf_model(config)
        engine = TorchEngine(config, shared_weights(hf, config), device="cuda")
        del hf
        torch.cuda.empty_cache()
        path = Path(args.tokenizer_json) if args.tokenizer_json else None
        if path is None:
            smol = load_model(str(smollm2_path()))
            tok = smol.tokenizer
        else:
            tok = tokenizer_from_json(path)
        rt = InferenceRuntime(engine, tok, rt_config)
        return rt, tok, config.vocab_size
    model: Model = load_model(str(smollm2_path()) if args.model == "smollm2" else args.model)
    if args.engine == "numpy":
        from llm_runner_svc.engines.numpy_engine import NumpyEngine

        eng = NumpyEngine(model.config, model.weights)
    else:
        from llm_runner_svc.engines.torch_engine import TorchEngine

        eng = TorchEngine(model.config, model.weights, device="cpu")  # type: ignore[assignment]
    return InferenceRuntime(eng, model.tokenizer, rt_config), model.tokenizer, \
        model.config.vocab_size


def median_step(rt: InferenceRuntime, prompts: list[list[int]], steps: int,
                constraint: Constraint | None) -> tuple[float, int]:
    """Median seconds of a step over `steps` steps with len(prompts) requests always in the
    batch; and how many constrained requests ended and were replaced."""
    ids = itertools.count()

    def submit(prompt: list[int]) -> None:
        rt.submit(GenerationRequest(
            f"r{next(ids)}", prompt,
            resolve(rt.config.sampling, temperature=0.0, max_new_tokens=steps + 8),
            ignore_eos=constraint is None, constraint=constraint))

    for p in prompts:
        submit(p)
    rt.step()  # the joins prefill here
    times, replaced = [], 0
    for i in range(steps):
        t0 = time.perf_counter()
        events = rt.step()
        times.append(time.perf_counter() - t0)
        for ev in events:
            if ev.finish_reason is not None:
                if ev.error:
                    raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
                replaced += 1
                submit(prompts[i % len(prompts)])
    for rid in list(rt._seqs):
        rt.cancel(rid)
    while rt.has_work:
        rt.step()
    return statistics.median(times), replaced


def mask_fill_ms(rt: InferenceRuntime, tok: Tokenizer, vocab: int, batch: int,
                 constraint: Constraint) -> float:
    """Host time to fill `batch` masks, the matchers part way into a document."""
    matchers = [rt.grammars.matcher(constraint) for _ in range(batch)]
    prefix = '{"name": "Ann Lee", "age": 41, "email": "ann@site.org", "tags": ["a", "b'
    for i, m in enumerate(matchers):  # spread over the document: keys, numbers, strings
        for t in tok.encode_fragment(prefix[:8 + (len(prefix) - 8) * (i % 7) // 6]):
            if not m.accept(t):
                break
    out = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        GrammarMatcher.fill(matchers, out)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("torch", "numpy", "torch-cpu"), default="numpy")
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokenizer-json", default="")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rt, tok, vocab = build(args)
    t0 = time.perf_counter()
    rt.preallocate()
    print(f"# preallocate {time.perf_counter() - t0:.1f} s", flush=True)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    rt.check_constraint(constraint)
    compile_ms = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    rt.check_constraint(constraint)
    cached_ms = 1000 * (time.perf_counter() - t0)
    text = "Write a short profile of a person who likes mountains and old maps. " * 4
    base = tok.encode(text, add_bos=tok.default_add_bos())[:args.prompt]
    rows = []
    print(f"# engine {args.engine}, vocab {vocab}, compile {compile_ms:.1f} ms (cached "
          f"{cached_ms:.3f} ms)")
    print(f"{'batch':>5} {'plain ms':>9} {'json ms':>9} {'x plain':>8} {'mask ms':>8} "
          f"{'ended':>6}")
    for b in (int(x) for x in args.batches.split(",")):
        prompts = [base[:len(base) - (i % 4)] for i in range(b)]
        plain = constrained = float("inf")
        for _ in range(args.repeats):  # alternated, the least of each: noise only adds
            plain = min(plain, median_step(rt, prompts, args.steps, None)[0])
            step, replaced = median_step(rt, prompts, args.steps, constraint)
            constrained = min(constrained, step)
        fill = mask_fill_ms(rt, tok, vocab, b, constraint)
        row = {"engine": args.engine, "batch": b, "plain_ms": 1000 * plain,
               "json_ms": 1000 * constrained, "ratio": constrained / plain,
               "mask_fill_ms": fill, "ended": replaced, "compile_ms": compile_ms}
        rows.append(row)
        print(f"{b:>5} {row['plain_ms']:>9.2f} {row['json_ms']:>9.2f} {row['ratio']:>8.3f} "
              f"{fill:>8.3f} {replaced:>6}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    rt.close()


if __name__ == "__main__":
    main()
