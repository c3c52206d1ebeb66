"""Prefix reuse through the Stage service: with context_cache.enable_reuse, a repeated prompt
reuses the cached pages (Diagnostics and metrics say how many positions), streams the same
tokens as its first run, and every page counts as free once the stage is idle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from stage_harness import StageServer

from llm_runner_svc.stage import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

PROMPT = ("Once upon a time, there was a little girl named Lily. She liked to play outside in "
          "the park with her big red ball. One day, she saw a small dog under a tree.")


@pytest.fixture(scope="module")
def server() -> Iterator[StageServer]:
    with StageServer(StageConfig(max_seq=512, prefix_cache=True)) as srv:
        yield srv


def _run(srv: StageServer, sid: int, **kw: Any) -> tuple[list[int], dict[str, Any]]:
    srv.admit_prepare(sid, text=PROMPT, temperature=0.8, seed=11, max_tokens=16, **kw)
    stream = srv.step([sid])
    got = stream.collect({sid})[sid]
    srv.stub.Finish(pb.FinishRequest(slot_id=sid))
    diag = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)).values)
    srv.stub.Reset(pb.ResetRequest(slot_id=sid))
    stream.half_close()
    return got["tokens"], diag


def test_repeated_prompt_reuses_the_cached_prefix(server: StageServer) -> None:
    first, d1 = _run(server, 1)
    again, d2 = _run(server, 2)
    assert again == first
    assert d1["cached_tokens"] == 0 and d1["prefix_cache_hits"] == 0
    assert d1["prefilled_tokens"] == d1["tokens_in"]
    assert d2["prefix_cache_hits"] == 1 and d2["cached_tokens"] > 0
    assert d2["cached_tokens"] + d2["prefilled_tokens"] == d2["tokens_in"]
    stats = server.wait_idle()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["prefix_cache_hits"] >= 1 and stats["prefix_cache_pages"] > 0
    assert stats["prefix_cache_hit_tokens"] >= d2["cached_tokens"]


def test_bypass_prefills_the_whole_prompt(server: StageServer) -> None:
    first, _ = _run(server, 3)
    again, diag = _run(server, 4, context_cache_lookup_policy=pb.CACHE_LOOKUP_POLICY_BYPASS)
    assert again == first
    assert diag["cached_tokens"] == 0 and diag["prefilled_tokens"] == diag["tokens_in"]


def test_an_undefined_policy_value_is_invalid(server: StageServer) -> None:
    with pytest.raises(grpc.RpcError) as info:
        server.admit(5, text=PROMPT, context_cache_commit_policy=7)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "CacheCommitPolicy 7" in (info.value.details() or "")
