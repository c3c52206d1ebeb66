"""Speculative decoding on one GPU with the torch engine: what a verify step, a draft
proposal and a layer-skip proposal cost against a plain decode step, measured in one process
on random bf16 weights at Qwen2.5 shapes (drawn on the device, as bench_gpu.py does).

For each batch size (every row at position `--prompt`, pages of its own; each step launched
and read back, as a speculative step is):
  - decode: one token per row (the captured decode graph);
  - verify: the last token and K proposed ones per row, with the greedy pick at each of the
    K + 1 positions (each row's K + 1 positions as decode rows of one captured decode step,
    its verify variant: the engine's plan holds verify rows of K tokens);
  - (a) replay: `InferenceRuntime` over the same engine and plan, plain (every request with
    `disable_spec_decode`) against speculative with a benchmark-only proposer that replays
    the target's own greedy continuation under the speculative configuration: a first
    speculative run whose proposals are never right records it (every step then holds K + 1
    rows per request, the step the timed run takes; a decode row's numbers depend on its
    token, position, the keys before it and the step's bucket, not on what the other rows
    hold), and the timed run proposes what it recorded, so acceptance is 1.0 by
    construction, but for the last few tokens of a request, whose shorter proposals change
    the bucket: when acceptance falls short, the next round replays the last run's own
    output (up to three); the acceptance and rounds are printed. In bf16 this continuation
    may differ from the plain run's at near-ties of random weights (`same_tokens_as_plain`
    in the JSON); in float32 the GPU tests show both are the same. The prompts' KV is
    cached by a first one-token run (prefix cache on), so every request's prefill is its
    last page and every request decodes from the same step; the rate counts the steps after
    it (their number, and ms per step in all and inside the engine, are in the JSON);
  - determinism: whether row 0 of a verify step gives the same logits, bit for bit, run
    again and beside other rows at other positions (`same_step_again`,
    `row_independent_of_others`);
  - (b) draft: a model of the 0.5B shape with the 7B vocabulary proposing for the 7B
    target: its one-token step and its two-token catch-up step (the tokens the last verify
    accepted; decode rows of its decode graph's verify variant, as verify rows run), so one
    proposal round of K tokens costs catch-up + (K - 1) steps;
  - (c) self: the target's first 1/4 of the layers and its head as the draft (sharing the
    target's weights), costed the same way.
Per round, the figures give the speedup at acceptance 1.0 (K + 1 tokens per target step):
(K + 1) x decode / (verify + round). Prints a table and writes every figure as JSON.

Usage: python benchmarks/bench_spec_gpu.py [--target qwen2.5-7b] [--draft qwen2.5-0.5b]
       [--batches 1,8,32] [--k 4] [--max-verify-tokens N] [--prompt 256] [--steps 64]
       [--json FILE]
       [--device cpu --smoke]   (a tiny shape on the CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.batch import Batch, Row, SampleSpec  # noqa: E402
from llm_runner_svc.engines.drafts import first_layers  # noqa: E402
from llm_runner_svc.engines.torch_engine import TorchEngine  # noqa: E402
from llm_runner_svc.engines.torch_weights import named_shape, random_weights  # noqa: E402
from llm_runner_svc.models.spec import ModelConfig, RopeStyle  # noqa: E402
from llm_runner_svc.runtime import (  # noqa: E402
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)
from llm_runner_svc.runtime.speculative import StatelessProposer  # noqa: E402

GREEDY = SampleSpec(0.0, 0, 1.0)
TINY = ModelConfig(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, max_position=1024,
                   rope_theta=1e6, rope_style=RopeStyle.HALF, rms_eps=1e-6, has_qkv_bias=True,
                   tie_embeddings=False)


class ReplayProposer(StatelessProposer):
    """Benchmark only: proposes the tokens a recorded greedy run produced next (the
    target's own continuation), so every proposal the verify step agrees with is accepted;
    with no recording, K tokens that are (nearly) never right."""

    def __init__(self, config: SpecConfig, continuations: dict[str, list[int]],
                 vocab_size: int) -> None:
        super().__init__(config)
        self.continuations = continuations
        self.vocab_size = vocab_size

    def propose_batch(self, seqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            done = len(seq.output_ids)
            recorded = self.continuations.get(seq.req.request_id)
            out.append(recorded[done:done + k] if recorded is not None else
                       [(seq.known[-1] + 1 + j) % self.vocab_size for j in range(k)])
        return out


def step_ms(engine: TorchEngine, rows: list[Row], reps: int, rounds: int = 3) -> float:
    """Milliseconds of one step of `rows`, launched and read back (median round)."""
    batch = Batch(rows)
    for _ in range(3):
        engine.read(engine.launch(batch))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.read(engine.launch(batch))
        times.append((time.perf_counter() - t0) / reps)
    return 1000 * statistics.median(times)


def rows_at(batch: int, position: int, length: int, verify: int, page_size: int,
            num_pages: int) -> list[Row]:
    """`batch` rows of `length` tokens at `position`, each on pages of its own; `verify`:
    that many trailing proposed tokens (greedy picks at each)."""
    per_row = (position + length - 1) // page_size + 1
    return [Row(tuple(range(7, 7 + length)), position,
                [(i * per_row + p) % num_pages for p in range(per_row)], GREEDY, verify=verify)
            for i in range(batch)]


class EngineClock:
    """Wall time spent inside an engine's launch and read (the rest of a runtime step is
    the host's: scheduling, proposals, acceptance, detokenizing)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine, self.seconds = engine, 0.0
        self._launch, self._read = engine.launch, engine.read

    def __enter__(self) -> EngineClock:
        def timed(fn: Any) -> Any:
            def call(arg: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(arg)
                finally:
                    self.seconds += time.perf_counter() - t
            return call
        self.engine.launch, self.engine.read = timed(self._launch), timed(self._read)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.launch, self.engine.read  # back to the class's methods


def run_requests(rt: InferenceRuntime, prompts: list[list[int]], steps: int,
                 speculate: bool = True, timing: dict[str, float] | None = None
                 ) -> tuple[dict[str, list[int]], float, float, float]:
    """Every prompt greedily to `steps` tokens in one batch: the tokens, the decode rate
    (tokens after each request's first over the time from the step where every request had
    its first token), acceptance and tokens per target step (0 when plain). `timing`, when
    given, gets the timed part's steps and ms per step, in the engine and in all."""
    clock = EngineClock(rt.engine)  # type: ignore[arg-type]
    for i, ids in enumerate(prompts):
        rt.submit(GenerationRequest(f"r{i}", ids, resolve(
            rt.config.sampling, temperature=0.0, max_new_tokens=steps), ignore_eos=True,
            disable_spec_decode=not speculate))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    metrics = []
    t_first, at_first, timed_steps, engine_s = 0.0, 0, 0, 0.0
    with clock:
        while rt.has_work:
            for ev in rt.step():
                got[ev.request_id] += ev.token_ids
                if ev.metrics is not None:
                    metrics.append(ev.metrics)
            if t_first:
                timed_steps += 1
            elif all(got.values()):
                t_first, at_first = time.perf_counter(), sum(len(t) for t in got.values())
                engine_s = clock.seconds
    elapsed = time.perf_counter() - t_first
    if timing is not None and timed_steps:
        timing.update(steps=timed_steps, step_ms=1000 * elapsed / timed_steps,
                      engine_ms=1000 * (clock.seconds - engine_s) / timed_steps)
    made = sum(len(t) for t in got.values()) - at_first
    proposed = sum(m.proposed_tokens for m in metrics)
    accepted = sum(m.accepted_tokens for m in metrics)
    targets = sum(m.target_steps for m in metrics)
    verified = sum(m.verified_tokens for m in metrics)
    return (got, made / elapsed, accepted / proposed if proposed else 0.0,
            verified / targets if targets else 0.0)


def replay(engine: TorchEngine, config: ModelConfig, rt_config: RuntimeConfig, batch: int,
           prompt: int, steps: int) -> dict[str, float]:
    """(a): plain decode, then speculative decode replaying the target's own greedy
    continuation under the speculative configuration (see the module docstring), same
    engine and plan; each further round replays the previous round's own output, up to
    three, until every proposal is accepted."""
    assert rt_config.spec is not None
    model = gpu_paths.random_model("target", config, None)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt), generator=gen).tolist()
    # with the prompts' KV cached, every request's prefill is its last page, all in one step,
    # so every request decodes from the same step on (else the first ones to be prefilled
    # run ahead, speculating, and may end before the last one starts)
    rt = InferenceRuntime(engine, model.tokenizer,
                          dataclasses.replace(rt_config, prefix_cache=True))
    rt.preallocate()  # the engine's plan already: a no-op
    run_requests(rt, prompts, 1, speculate=False)  # warm-up, and the prompts' KV cached
    plain_timing: dict[str, float] = {}
    spec_timing: dict[str, float] = {}
    plain, plain_tps, _, _ = run_requests(rt, prompts, steps, speculate=False,
                                          timing=plain_timing)
    rt.proposer = ReplayProposer(rt_config.spec, {}, config.vocab_size)  # type: ignore
    replayed = run_requests(rt, prompts, steps)[0]  # the recording run
    rounds = 0
    while True:
        rounds += 1
        rt.proposer = ReplayProposer(rt_config.spec, replayed,  # type: ignore[assignment]
                                     config.vocab_size)
        got, spec_tps, acceptance, per_step = run_requests(rt, prompts, steps,
                                                           timing=spec_timing)
        if acceptance == 1.0 or rounds == 3:
            break
        replayed = got
    same = sum(a == b for r in plain for a, b in zip(plain[r], got[r], strict=True))
    return {"plain_tok_s": plain_tps, "replay_tok_s": spec_tps,
            "replay_speedup": spec_tps / plain_tps, "replay_acceptance": acceptance,
            "replay_tokens_per_step": per_step, "replay_rounds": rounds,
            "same_tokens_as_plain": same / sum(len(t) for t in plain.values()),
            **{f"plain_{k}": v for k, v in plain_timing.items()},
            **{f"replay_{k}": v for k, v in spec_timing.items()}}


def determinism(engine: TorchEngine, batch: int, k: int, position: int, page_size: int,
                num_pages: int) -> dict[str, bool]:
    """Whether a verify step's numbers for row 0 are the same (bit for bit, its K + 1
    logits rows) when the same step runs again, and when the other rows hold other tokens
    at other positions (a decode row's numbers should depend on its own token, position and
    keys only). Rows at staggered positions, as a runtime's rows are."""
    def logits_of_row0(tokens_shift: int, stagger: int) -> torch.Tensor:
        rows, next_page = [], 0
        for i in range(batch):
            start = max(1, position - i * stagger)
            used = (start + k) // page_size + 1
            pages = [(next_page + p) % num_pages for p in range(used)]
            next_page += used
            tokens = tuple((7 + j + (tokens_shift if i else 0)) % 500 for j in range(k + 1))
            rows.append(Row(tokens, start, pages, GREEDY, verify=k))
        engine.read(engine.launch(Batch(rows)))
        logits = engine.state.logits
        return torch.cat([logits[:1], logits[batch:batch + k]]).clone()
    base = logits_of_row0(0, 3)
    again = logits_of_row0(0, 3)
    others = logits_of_row0(17, 5)
    return {"same_step_again": bool(torch.equal(base, again)),
            "row_independent_of_others": bool(torch.equal(base, others))}


def draft_costs(draft: TorchEngine, batch: int, prompt: int, k: int, reps: int,
                page_size: int, num_pages: int) -> dict[str, float]:
    """A draft's one-token step and two-token catch-up step; one round of K proposals."""
    one = step_ms(draft, rows_at(batch, prompt, 1, 0, page_size, num_pages), reps)
    catch_up = step_ms(draft, rows_at(batch, prompt, 2, 0, page_size, num_pages), reps)
    return {"step_ms": one, "catch_up_ms": catch_up, "round_ms": catch_up + (k - 1) * one,
            "per_token_ms": (catch_up + (k - 1) * one) / k}


@contextlib.contextmanager
def failure_noted(result: dict[str, Any], name: str) -> Iterator[None]:
    """A part that fails leaves its error in `result` and the run goes on (a GPU run that
    returns some figures beats one that returns none)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-7b")
    ap.add_argument("--draft", default="qwen2.5-0.5b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-verify-tokens", type=int, default=0,
                    help="spec_decode.max_verify_tokens for (a) (0: every proposal whole)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape (for the CPU)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = TINY if args.smoke else named_shape(args.target)
    draft_config = dataclasses.replace(TINY if args.smoke else named_shape(args.draft),
                                       num_layers=2 if args.smoke else
                                       named_shape(args.draft).num_layers,
                                       vocab_size=config.vocab_size)
    k = args.k
    # the plan holds verify rows of K tokens: the target captures verify variants of its
    # decode graph for up to max_batch * (K + 1) rows
    rt_config = RuntimeConfig(max_batch=max(batches), max_seq=args.prompt + args.steps + 32,
                              spec=SpecConfig("ngram", k,
                                                  max_verify_tokens=args.max_verify_tokens))
    t0 = time.perf_counter()
    target = TorchEngine(config, random_weights(config, device, dtype, seed=0), device=device)
    model = gpu_paths.random_model("target", config, None)
    rt = InferenceRuntime(target, model.tokenizer, rt_config)
    rt.preallocate()
    plan = rt.plan
    ps, pages = plan.page_size, plan.num_pages
    draft = TorchEngine(draft_config, random_weights(draft_config, device, dtype, seed=1),
                        device=device)
    draft.preallocate(plan)  # (as DraftProposer does: the plan's K lets a catch-up row of up
    skip = first_layers(target, max(1, config.num_layers // 4))  # to K + 1 tokens run as
    skip.preallocate(plan)  #                                      decode rows)
    print(f"# engines built and captured in {time.perf_counter() - t0:.1f} s "
          f"(target {args.target if not args.smoke else 'tiny'}, {config.num_layers} layers; "
          f"draft {draft_config.num_layers} layers; self {skip.config.num_layers} layers)",
          flush=True)
    results = []
    for b in batches:
        decode = step_ms(target, rows_at(b, args.prompt, 1, 0, ps, pages), args.reps)
        verify = step_ms(target, rows_at(b, args.prompt, k + 1, k, ps, pages), args.reps)
        r: dict[str, Any] = {"batch": b, "k": k, "decode_ms": decode, "verify_ms": verify,
                             "verify_over_decode": verify / decode,
                             "best_speedup": (k + 1) * decode / verify}
        for name, eng in (("draft", draft), ("self", skip)):
            with failure_noted(r, name):
                costs = draft_costs(eng, b, args.prompt, k, args.reps, ps, pages)
                r.update({f"{name}_{key}": v for key, v in costs.items()})
                r[f"{name}_speedup_at_1"] = (k + 1) * decode / (verify + costs["round_ms"])
        with failure_noted(r, "determinism"):
            r.update(determinism(target, b, k, args.prompt, ps, pages))
        with failure_noted(r, "replay"):
            r.update(replay(target, config, rt_config, b, args.prompt, args.steps))
        if b == batches[0]:  # the verify step's cost by proposal length
            r["verify_ms_by_k"] = {kk: step_ms(target, rows_at(b, args.prompt, kk + 1, kk, ps,
                                                               pages), args.reps)
                                   for kk in (1, 2, 4, 8)}
        results.append(r)
        print(json.dumps({key: round(v, 4) if isinstance(v, float) else v
                          for key, v in r.items()}), flush=True)
    print(f"\n{args.target if not args.smoke else 'tiny'} on {device}, K={k}, position "
          f"{args.prompt}; steps launched and read back; ms")
    print("| batch | decode | verify (K+1) | verify/decode | (a) replay tok/s vs plain | "
          "acceptance | (b) draft step / catch-up / per token | (b) at acc. 1 | "
          "(c) self step / catch-up / per token | (c) at acc. 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if any(f"{name}_error" in r for name in ("draft", "self", "replay")):
            continue  # its JSON line above has the figures and the error
        print(f"| {r['batch']} | {r['decode_ms']:.2f} | {r['verify_ms']:.2f} | "
              f"{r['verify_over_decode']:.2f}x | {r['replay_tok_s']:.0f} vs "
              f"{r['plain_tok_s']:.0f} = {r['replay_speedup']:.2f}x | "
              f"{r['replay_acceptance']:.2f} | {r['draft_step_ms']:.2f} / "
              f"{r['draft_catch_up_ms']:.2f} / {r['draft_per_token_ms']:.2f} | "
              f"{r['draft_speedup_at_1']:.2f}x | {r['self_step_ms']:.2f} / "
              f"{r['self_catch_up_ms']:.2f} / {r['self_per_token_ms']:.2f} | "
              f"{r['self_speedup_at_1']:.2f}x |")
    by_k = results[0].get("verify_ms_by_k", {})
    print(f"verify step at batch {results[0]['batch']} by K (decode "
          f"{results[0]['decode_ms']:.2f} ms): " + ", ".join(
              f"K={kk} {ms:.2f} ms ({ms / results[0]['decode_ms']:.2f}x)"
              for kk, ms in by_k.items()))
    print("(a) replays the target's own greedy continuation under speculation, recorded by a "
          "first speculative run (replay_rounds, same_tokens_as_plain in the JSON)")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "draft": args.draft,
                                               "device": str(device), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
