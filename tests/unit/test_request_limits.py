"""Per-request limits and the hidden port's shared-memory budget: stage keys, validation,
and which answer each limit gives (INVALID_ARGUMENT or a refusal with its reason)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_runner_svc.errors import InvalidArgument, ResourceExhausted
from llm_runner_svc.stage import ChatTurn, MediaItem, StageRequest, load_stage_config
from llm_runner_svc.stage.admission import Refusal, Refused, check_limits
from llm_runner_svc.stage.limits import PROMPT_BYTES_PER_TOKEN, RequestLimits, check_malformed
from llm_runner_svc.stage.runner_keys import ConfigError
from llm_runner_svc.stage.shm_budget import ShmBudget, ring_bytes_for
from llm_runner_svc.stage.shm_ring import HEADER_BYTES


def _config(tmp_path: Path, **keys: object) -> Path:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"stages": [{"id": "s", "runner": "llm.backbone", **keys}]}))
    return path


def test_stage_keys_set_the_limits(tmp_path: Path) -> None:
    cfg = load_stage_config(_config(tmp_path, maxPromptBytes=100, maxStopStrings=2,
                                    maxStopBytes=10, maxLogitBias=3, maxMessages=4,
                                    maxMediaParts=0, maxRequestIdBytes=8,
                                    ports={"hidden": {"maxShmSubscriptions": 2,
                                                      "maxShmBytes": 1 << 20}}))
    assert cfg.limits == RequestLimits(100, 2, 10, 3, 4, 0, 8)
    assert (cfg.max_shm_subscriptions, cfg.max_shm_bytes) == (2, 1 << 20)
    assert load_stage_config(_config(tmp_path)).limits == RequestLimits()


@pytest.mark.parametrize("key,value", [("maxStopStrings", -1), ("maxMessages", 0),
                                       ("maxPromptBytes", "big"), ("maxLogitBias", True),
                                       ("maxRequestIdBytes", 0)])
def test_bad_limit_values_fail_at_load_naming_the_key(tmp_path: Path, key: str,
                                                      value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        load_stage_config(_config(tmp_path, **{key: value}))


def test_prompt_byte_limit_defaults_to_max_seq_times_bytes_per_token() -> None:
    assert RequestLimits().prompt_bytes(512) == 512 * PROMPT_BYTES_PER_TOKEN
    assert RequestLimits(max_prompt_bytes=10).prompt_bytes(512) == 10
    limits = RequestLimits(max_prompt_bytes=10)
    check_malformed(limits, 512, StageRequest("r", text="x" * 10))
    with pytest.raises(InvalidArgument, match="11 bytes; the limit is 10 .maxPromptBytes"):
        check_malformed(limits, 512, StageRequest("r", text="é" * 5 + "x"))
    with pytest.raises(InvalidArgument, match="chat messages hold 12 bytes"):
        check_malformed(limits, 512, StageRequest(
            "r", messages=(ChatTurn("user", "x" * 6), ChatTurn("user", "y" * 6))))
    with pytest.raises(InvalidArgument, match="request_id has 300 bytes.*maxRequestIdBytes"):
        check_malformed(RequestLimits(), 512, StageRequest("r" * 300, text="hi"))


@pytest.mark.parametrize("kw,refusal,needle", [
    (dict(stop=("a",) * 3), Refusal.SAMPLING_OUT_OF_RANGE, "3 stop strings; the limit is 2"),
    (dict(stop=("abcdef", "ghijk")), Refusal.SAMPLING_OUT_OF_RANGE, "11 bytes; the limit is 10"),
    (dict(logit_bias={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}), Refusal.SAMPLING_OUT_OF_RANGE,
     "maxLogitBias"),
    (dict(media=(MediaItem("image/png", b"x"),)), Refusal.MEDIA_UNSUPPORTED, "maxMediaParts"),
])
def test_limits_beyond_are_refusals_naming_the_key(kw: dict, refusal: Refusal,
                                                   needle: str) -> None:
    limits = RequestLimits(max_stop_strings=2, max_stop_bytes=10, max_logit_bias=3,
                           max_messages=1, max_media_parts=0)
    check_limits(limits, 512, StageRequest("r", text="hi", stop=("ab",)))
    with pytest.raises(Refused) as err:
        check_limits(limits, 512, StageRequest("r", text="hi", **kw))
    assert err.value.refusal is refusal and needle in err.value.reason
    with pytest.raises(Refused, match="2 chat messages.*maxMessages") as err:
        check_limits(limits, 512, StageRequest("r", messages=(ChatTurn("user", "a"),) * 2))
    assert err.value.refusal is Refusal.PROMPT_TOO_LONG


def test_ring_size_follows_the_port_width_and_the_message_limit() -> None:
    assert ring_bytes_for(64, 512, 16 << 20) == 2 * 512 * 2 * 64 * 4  # stories260K: 512 KiB
    assert ring_bytes_for(576, 2048, 16 << 20) == 2 * 2048 * 2 * 576 * 4  # SmolLM2
    huge = ring_bytes_for(8192, 32768, 16 << 20)  # chunked under the message limit
    assert huge <= 2 * (16 << 20) and huge >= 2 * 2 * 8192 * 4


def test_shm_budget_counts_rings_and_bytes() -> None:
    budget = ShmBudget(4096, max_rings=2, max_bytes=1 << 20)
    budget.reserve()
    budget.reserve()
    with pytest.raises(ResourceExhausted, match="maxShmSubscriptions"):
        budget.reserve()
    assert (budget.num_rings, budget.num_bytes) == (2, 2 * (4096 + HEADER_BYTES))
    budget.release()
    budget.release()
    assert (budget.num_rings, budget.num_bytes) == (0, 0)
    small = ShmBudget(4096, max_rings=8, max_bytes=4096 + HEADER_BYTES)
    small.reserve()
    with pytest.raises(ResourceExhausted, match="maxShmBytes"):
        small.reserve()
