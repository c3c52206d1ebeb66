"""Structured output, what it buys and what it costs, on the corpus of tests/data/structured/.

service: every schema x prompt, every regex and every choice list through the real service
path (stage, orchestrator and gateway processes; the `openai` package as the client), with
the constraint (response_format json_schema, guided_regex, guided_choice) and without it (the
same prompt, which spells out the schema, the format or the choices); per model and mode the
share of answers that parse as JSON, that validate against their schema (jsonschema), that
match their regex or are one of their choices, that ran out of tokens, and the mean tokens.
Models: `smollm2` (SmolLM2-135M-Instruct, greedy) and `random` (a tiny random-weight Llama
over SmolLM2's vocabulary and chat template; it samples at temperature 1 with a seed per
request, since a greedy random model can repeat one digit of a number until max_tokens).

grammar: the runtime's own compiler (llm_runner_svc.runtime.grammar.Grammars, llguidance)
over SmolLM2's tokenizer: per schema the time to compile and fill a first mask, cold and
again from the compiled-constraint cache; then the host time to fill the masks of a batch
of 32 constrained rows per decode step, each row following its schema's example token by
token (a row whose example ends starts over), as median and 95th percentile.

Usage: python benchmarks/bench_structured.py [--models smollm2,random] [--prompts 5]
       [--schemas 30] [--sections service,grammar] [--max-tokens 400] [--free-max-tokens 400]
       [--batch 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from deployment import Deployment  # noqa: E402
from http_gateway import LONG, GatewayProc  # noqa: E402
from structured_corpus import (  # noqa: E402
    Answer,
    ask,
    build_random_smollm2,
    choices,
    json_schema_format,
    judge_json,
    lenient_json,
    prompts,
    regexes,
    schema_prompt,
    schemas,
)

MODEL = "backbone"
MAX_BATCH = 8
Case = tuple[str, dict[str, Any] | None, Callable[[Answer], dict[str, bool]]]


def _cases(args: argparse.Namespace, constrained: bool) -> dict[str, list[Case]]:
    """Per kind (json, regex, choice), the (prompt, constraint, judge) of every request."""
    def json_judge(schema: dict[str, Any]) -> Callable[[Answer], dict[str, bool]]:
        def judge(a: Answer) -> dict[str, bool]:
            parses, valid, _ = judge_json(a.text, schema)
            lenient = judge_json(lenient_json(a.text), schema)
            return {"parse": parses, "valid": valid, "lenient_valid": lenient[1]}
        return judge

    def regex_judge(regex: str) -> Callable[[Answer], dict[str, bool]]:
        return lambda a: {"valid": re.fullmatch(regex, a.text) is not None,
                          "lenient_valid": re.fullmatch(regex, a.text.strip()) is not None}

    def choice_judge(options: list[str]) -> Callable[[Answer], dict[str, bool]]:
        return lambda a: {"valid": a.text in options,
                          "lenient_valid": a.text.strip().strip(".").lower()
                          in [o.lower() for o in options]}

    out: dict[str, list[Case]] = {"json": [], "regex": [], "choice": []}
    for entry in schemas()[:args.schemas]:
        for template in prompts()[:args.prompts]:
            out["json"].append((schema_prompt(template, entry),
                                json_schema_format(entry) if constrained else None,
                                json_judge(entry["schema"])))
    for spec in regexes():
        out["regex"].append((spec["prompt"], {"guided_regex": spec["regex"]} if constrained
                             else None, regex_judge(spec["regex"])))
    for spec in choices():
        out["choice"].append((spec["prompt"], {"guided_choice": spec["choices"]}
                              if constrained else None, choice_judge(spec["choices"])))
    return out


def run_service(label: str, artifact: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment(Path(tmp), {"backbone": {"artifact": artifact, "maxSeq": 2048,
                                                  "maxBatch": MAX_BATCH}})
        gw = GatewayProc(dep.target)
        api = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0,
                     timeout=10 * LONG)
        sampled = label == "random"
        try:
            for constrained in (True, False):
                for kind, cases in _cases(args, constrained).items():
                    max_tokens = args.max_tokens if kind == "json" else args.short_max_tokens
                    if kind == "json" and not constrained:
                        max_tokens = args.free_max_tokens

                    def one(i: int, cases: list[Case] = cases, max_tokens: int = max_tokens
                            ) -> Answer:
                        prompt, constraint, _ = cases[i]
                        return ask(api, MODEL, prompt, max_tokens, constraint,
                                   seed=i if sampled else None)

                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(MAX_BATCH) as pool:
                        answers = list(pool.map(one, range(len(cases))))
                    wall_s = time.perf_counter() - t0
                    judged = [judge(a) for (_, _, judge), a in zip(cases, answers, strict=True)]
                    n = len(answers)

                    def pct(key: str, judged: list[dict[str, bool]] = judged, n: int = n
                            ) -> float | None:
                        if key not in judged[0]:
                            return None
                        return 100.0 * sum(j[key] for j in judged) / n

                    rows.append({
                        "model": label, "kind": kind,
                        "mode": "constrained" if constrained else "free", "n": n,
                        "parse_pct": pct("parse"), "valid_pct": pct("valid"),
                        "lenient_valid_pct": pct("lenient_valid"),
                        "length_pct": 100.0 * sum(a.finish_reason == "length"
                                                  for a in answers) / n,
                        "mean_tokens": statistics.fmean(a.completion_tokens for a in answers),
                        "max_tokens": max_tokens, "wall_s": wall_s})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            gw.stop()
            dep.close()
    return rows


def grammar_times(args: argparse.Namespace) -> dict[str, Any]:
    from llm_runner_svc.models import load_model
    from llm_runner_svc.runtime.constraint import Constraint
    from llm_runner_svc.runtime.grammar import GrammarMatcher, Grammars

    model = load_model("smollm2")
    tok, vocab = model.tokenizer, model.config.vocab_size
    grammars = Grammars(tok, vocab, model.config.eos_ids)
    words = -(-vocab // 32)
    one = np.zeros((1, words), dtype=np.int32)
    t0 = time.perf_counter()
    grammars.matcher(Constraint("json_object"))  # the token tables, built once per tokenizer
    tables_s = time.perf_counter() - t0
    entries = schemas()[:args.schemas]
    constraints = [Constraint("json_schema", json.dumps(e["schema"])) for e in entries]
    per_schema = []
    for entry, constraint in zip(entries, constraints, strict=True):
        times = []
        for _ in range(2):  # cold, then from the cache
            t0 = time.perf_counter()
            m = grammars.matcher(constraint)
            GrammarMatcher.fill([m], one)
            times.append(1000 * (time.perf_counter() - t0))
        per_schema.append({"schema": entry["name"], "cold_ms": times[0], "cached_ms": times[1]})
    examples = [tok.encode(json.dumps(e["example"], separators=(",", ":")), add_bos=False)
                for e in entries]
    batch = np.zeros((args.batch, words), dtype=np.int32)
    rows = [(i % len(entries), grammars.matcher(constraints[i % len(entries)]), 0)
            for i in range(args.batch)]
    step_ms = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        GrammarMatcher.fill([m for _, m, _ in rows], batch)
        step_ms.append(1000 * (time.perf_counter() - t0))
        advanced: list[tuple[int, Any, int]] = []
        for k, m, pos in rows:
            token = examples[k][pos]
            word, bit = divmod(token, 32)
            assert (int(batch[len(advanced)][word]) >> bit) & 1, (entries[k]["name"], pos)
            assert m.accept(token)
            if pos + 1 == len(examples[k]):
                advanced.append((k, grammars.matcher(constraints[k]), 0))
            else:
                advanced.append((k, m, pos + 1))
        rows = advanced
    step_ms.sort()
    return {"tables_s": tables_s, "per_schema": per_schema, "batch": args.batch,
            "mask_median_ms": statistics.median(step_ms),
            "mask_p95_ms": step_ms[int(0.95 * (len(step_ms) - 1))],
            "threads": os.cpu_count()}


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_service(rows: list[dict[str, Any]]) -> None:
    print("| model | kind | mode | n | parse % | valid % | valid % (lenient) | "
          "out of tokens % | mean tokens | max_tokens | wall s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['kind']} | {r['mode']} | {r['n']} | "
              f"{_fmt(r['parse_pct'])} | {_fmt(r['valid_pct'])} | "
              f"{_fmt(r['lenient_valid_pct'])} | {_fmt(r['length_pct'])} | "
              f"{r['mean_tokens']:.0f} | {r['max_tokens']} | {r['wall_s']:.0f} |")


def print_grammar(g: dict[str, Any]) -> None:
    cold = [s["cold_ms"] for s in g["per_schema"]]
    cached = [s["cached_ms"] for s in g["per_schema"]]
    print(f"\ntoken tables (once per tokenizer): {g['tables_s']:.2f} s")
    print("| schema | compile + first mask, cold ms | from the cache ms |")
    print("|---|---:|---:|")
    for s in g["per_schema"]:
        print(f"| {s['schema']} | {s['cold_ms']:.2f} | {s['cached_ms']:.2f} |")
    print(f"| median | {statistics.median(cold):.2f} | {statistics.median(cached):.2f} |")
    print(f"| max | {max(cold):.2f} | {max(cached):.2f} |")
    print(f"\nmasks of {g['batch']} rows per step ({g['threads']} CPUs): median "
          f"{g['mask_median_ms']:.2f} ms, p95 {g['mask_p95_ms']:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,random")
    ap.add_argument("--sections", default="service,grammar")
    ap.add_argument("--schemas", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=400, help="constrained JSON")
    ap.add_argument("--free-max-tokens", type=int, default=400, help="unconstrained JSON")
    ap.add_argument("--short-max-tokens", type=int, default=48, help="regexes and choices")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    sections = args.sections.split(",")
    print(f"# bench_structured: {platform.node()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    if "service" in sections:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for label in args.models.split(","):
                artifact = (str(build_random_smollm2(Path(tmp) / "random"))
                            if label == "random" else label)
                rows += run_service(label, artifact, args)
        print_service(rows)
    if "grammar" in sections:
        print_grammar(grammar_times(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
