"""Prefix reuse through the Stage service: with context_cache.enable_reuse, a repeated prompt
reuses the cached pages (Diagnostics and metrics say how many positions), streams the same
tokens as its first run, and every page counts as free once the stage is idle."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict
from llm_stage_client.hidden import HiddenWindow
from stage_harness import StageServer
from test_hidden_port import Consumer

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
    gauge = server.stage.metrics.registry.get_sample_value
    assert gauge("llmstage_prefix_cache_hits") == stats["prefix_cache_hits"]
    assert gauge("llmstage_prefix_cache_pages") == stats["prefix_cache_pages"]


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


def test_a_reused_prefix_still_publishes_the_whole_prefill_window(stories) -> None:
    """With max_snapshots, the repeated request's subscriber receives every prompt position
    (the reused ones from the cache) and the same bytes, with the same published CRC, as
    the first run and as a run that bypasses the cache."""
    cfg = StageConfig(max_seq=512, emits=("text", "tokens", "hidden"), prefix_cache=True,
                      prefix_cache_snapshots=64)
    runs = []
    with StageServer(cfg) as srv:
        for sid, policy in ((1, pb.CACHE_LOOKUP_POLICY_USE_CACHE),
                            (2, pb.CACHE_LOOKUP_POLICY_USE_CACHE),
                            (3, pb.CACHE_LOOKUP_POLICY_BYPASS)):
            consumer = Consumer(srv, f"h{sid}")
            tokens, diag = _run(srv, sid, ports=["text", "hidden"], request_id=f"h{sid}",
                                context_cache_lookup_policy=policy)
            consumer.join(30)
            assert consumer.error is None
            windows = [m for m in consumer.messages if isinstance(m, HiddenWindow)]
            crc = 0
            for w in windows:
                crc = zlib.crc32(w.states.tobytes(), crc)
            assert diag["hidden_states_crc32"] == crc
            prefill = [w for w in windows if w.is_prefill]
            assert [w.start_position for w in prefill][0] == 0
            ids = tuple(t for w in prefill for t in w.token_ids)
            assert ids == tuple(stories.tokenizer.encode(PROMPT))
            runs.append((tokens, diag, np.concatenate([w.states for w in windows]),
                         [(w.start_position, len(w.token_ids)) for w in prefill]))
        assert srv.stats()["prefix_cache_hidden_bytes"] > 0
    (t1, d1, s1, w1), (t2, d2, s2, w2), (t3, d3, s3, w3) = runs
    assert w2 == w1 == w3  # the prefill window in the same messages, the reused part joined
    assert d1["cached_tokens"] == d3["cached_tokens"] == 0 and d2["cached_tokens"] > 0
    assert t2 == t1 == t3
    assert s2.tobytes() == s1.tobytes() == s3.tobytes()
    assert d2["hidden_states_crc32"] == d1["hidden_states_crc32"] == d3["hidden_states_crc32"]
