"""A multi-turn conversation through the orchestrator, for the prefix-reuse integration test
and benchmarks/bench_conversation.py.

Each turn's prompt is the previous turn's prompt, its reply and a new user turn, sent as
token ids (so the earlier turns are the same tokens every time); replies are greedy, of a
fixed length. Per turn: the reply and what the runner's per-request Diagnostics (relayed
in the orchestrator's final report) say it reused and prefilled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployment import Deployment, collect

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    reply: list[int]
    cached_tokens: int
    prefilled_tokens: int


def conversation_deployment(tmp: Path, reuse: bool, artifact: str | None = None,
                            max_seq: int = 512) -> Deployment:
    """One runner (prefix reuse on or off) behind an orchestrator."""
    stage: dict[str, Any] = {"maxSeq": max_seq,
                             "config": {"context_cache": {"enable_reuse": reuse}}}
    if artifact:
        stage["artifact"] = artifact
    tmp.mkdir(parents=True, exist_ok=True)
    return Deployment(tmp, {"backbone": stage})


def user_turns(vocab_size: int, turns: int, length: int, seed: int = 0) -> list[list[int]]:
    """`turns` user turns of `length` token ids each (ids 3 and up: clear of the special
    ids of the models we serve)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(turns)]


def vocab_size(dep: Deployment) -> int:
    return int(dep.all_stages[0].stub.Describe(pb.DescribeRequest(), timeout=10).model.vocab_size)


def converse(dep: Deployment, users: list[list[int]], reply_tokens: int,
             timeout_s: float = 300.0) -> Iterator[Turn]:
    """The conversation `users` through `dep`'s orchestrator, one turn after another, each
    turn yielded when its final report has come."""
    prompt: list[int] = []
    for ids in users:
        prompt += ids
        req = opb.GenerateRequest(request=pb.GenerationRequest(
            token_ids=pb.TokenIds(ids=prompt), ignore_eos=True,
            sampling=pb.SamplingOverrides(temperature=0.0, max_tokens=reply_tokens)))
        reply, _, final = collect(dep.stub.Generate(req, timeout=timeout_s))
        assert final is not None, "no final report"
        diag = final.diagnostics["backbone"]
        yield Turn(len(prompt), reply, int(diag["cached_tokens"]), int(diag["prefilled_tokens"]))
        prompt += reply
