"""Speculative decoding against plain decode, in one process on the same engine.

An input-grounded task (the model is asked to repeat a passage) runs greedily at batch 1
twice: plain, then with `ngram` prompt lookup proposing K tokens. The answer ends where the
model ends it (end of sequence), so every token measured is part of the task; with
`--ignore-eos` the run goes on to `--max-tokens` and measures the model's chatter after the
answer too. Prints tokens per target step, acceptance rate and tokens/s of both, and checks
the outputs are identical. The runs are interleaved over several rounds and the median
taken, since the host's load drifts.

Usage: python benchmarks/bench_spec.py [--model smollm2] [--engine numpy] [--k 4,6,8]
       [--self N:K,...] [--max-tokens 160] [--rounds 3] [--ignore-eos]
"""

from __future__ import annotations

import argparse
import statistics
import time

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.drafts import create_draft_engine
from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and wrote the weather in a leather logbook. Ships passing "
    "the rocky point saw the beam sweep across the water every twelve seconds, and they knew "
    "the harbour was near. In winter the storms rattled the windows, but the light never "
    "failed, because the keeper never forgot his duty to the sailors at sea.")
TASK = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"


def run(model, engine_name: str, spec: SpecConfig | None, max_tokens: int,
        ignore_eos: bool = False) -> dict:
    engine = create_engine(engine_name, model.config, model.weights)
    draft = None if spec is None else create_draft_engine(
        spec.method, engine_name, model, engine, spec.draft_layers, spec.draft_checkpoint)
    rt = InferenceRuntime(engine, model.tokenizer,
                          RuntimeConfig(max_batch=1, max_seq=1024, spec=spec), draft)
    rt.preallocate()
    try:
        if model.chat_template is not None:
            text = model.chat_template.render([{"role": "user", "content": TASK}])
            ids = model.tokenizer.encode(text, add_bos=False)
        else:
            ids = model.tokenizer.encode(TASK, add_bos=True)
        req = GenerationRequest("bench", ids, resolve(rt.config.sampling, temperature=0.0,
                                                      max_new_tokens=max_tokens),
                                ignore_eos=ignore_eos)
        tokens: list[int] = []
        t0 = time.perf_counter()
        metrics = None
        for ev in rt.generate(req):
            tokens += ev.token_ids
            metrics = ev.metrics or metrics
        wall = time.perf_counter() - t0
        assert metrics is not None
        return {"tokens": tokens, "tps": metrics.tokens_per_s, "wall_s": wall,
                "per_step": metrics.tokens_per_target_step or 1.0,
                "acceptance": metrics.acceptance_rate}
    finally:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engine", default="numpy")
    ap.add_argument("--k", default="4,6,8")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--self", default="", metavar="N:K,...",
                    help="also the model's first N layers as the draft, proposing K")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = load_model(args.model)
    run(model, args.engine, None, 8)  # warm-up: first-call costs stay out of the figures
    specs: list[tuple[str, SpecConfig | None]] = [("plain", None)]
    specs += [(f"ngram K={k}", SpecConfig(proposal_tokens=int(k))) for k in args.k.split(",")]
    for item in filter(None, args.self.split(",")):
        n, k = (int(v) for v in item.split(":"))
        specs.append((f"self N={n} K={k}", SpecConfig("self", k, draft_layers=n)))
    results: dict[str, list[dict]] = {name: [] for name, _ in specs}
    for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits all alike
        for name, spec in specs:
            results[name].append(run(model, args.engine, spec, args.max_tokens,
                                     args.ignore_eos))
    plain = results["plain"]
    base = statistics.median(r["tps"] for r in plain)
    ending = f"{args.max_tokens} tokens" if args.ignore_eos else \
        f"{len(plain[0]['tokens'])} tokens (to the end of the answer)"
    print(f"model {model.name}, engine {args.engine}, batch 1, {ending}, greedy, median of "
          f"{args.rounds} interleaved rounds")
    print("| decode | tokens/target step | acceptance | decode tok/s | vs plain | same output |")
    print("|---|---|---|---|---|---|")
    for name, _ in specs:
        rs = results[name]
        tps = statistics.median(r["tps"] for r in rs)
        same = all(r["tokens"] == plain[0]["tokens"] for r in rs)
        acc = "-" if name == "plain" else f"{rs[0]['acceptance']:.2f}"
        print(f"| {name} | {rs[0]['per_step']:.2f} | {acc} | {tps:.1f} | {tps / base:.2f}x | "
              f"{same} |")


if __name__ == "__main__":
    main()
