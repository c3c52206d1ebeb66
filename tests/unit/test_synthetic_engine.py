"""The synthetic engine: picks that depend only on a row's last position and token, a step
time waited for from the step's launch (steps one after another, as on a device), the
runtime and a Stage service over real gRPC running on it, and its deployment keys checked."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from stage_harness import StageServer

from llm_runner_svc.cli import main as cli_main
from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.batch import Batch, Row, SampleSpec
from llm_runner_svc.engines.synthetic_engine import (
    FIRST_ORDINARY_ID,
    SyntheticEngine,
    ordinary_ids,
    synthetic_pick,
)
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, Unimplemented
from llm_runner_svc.models import Model
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)
from llm_runner_svc.stage import load_stage_config
from llm_runner_svc.stage.config import ConfigError, StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

PLAN = EnginePlan(max_batch=8, max_seq=512, page_size=16, num_pages=256)
SPEC = SampleSpec(temperature=1.0, top_k=50, top_p=0.8, uniform=0.5)
STEP_S = 0.1  # long beside sleep's and the host's jitter on a loaded 2-core machine


def _engine(stories: Model, step_ms: float = 0.0, token_us: float = 0.0) -> SyntheticEngine:
    engine = create_engine("synthetic", stories.config, stories.weights, step_ms=step_ms,
                           token_us=token_us)
    assert isinstance(engine, SyntheticEngine)
    engine.preallocate(PLAN)
    return engine


def _row(tokens: tuple[int, ...], start: int, sample: SampleSpec | None = SPEC) -> Row:
    end = start + len(tokens)
    return Row(tokens, start, tuple(range(-(-end // PLAN.page_size))), sample=sample)


def _picks(engine: SyntheticEngine, rows: list[Row]) -> list[int | None]:
    return list(engine.read(engine.launch(Batch(tuple(rows)))).picks)


# ---- picks ---------------------------------------------------------------------------------

def test_picks_depend_only_on_the_last_position_and_token(stories):
    engine = _engine(stories)
    rows = [_row((1, 300, 301, 302), 0), _row((400,), 37), _row((5, 6), 90), _row((77,), 3)]
    together = _picks(engine, rows)
    reversed_order = _picks(engine, rows[::-1])[::-1]
    alone = [_picks(engine, [r])[0] for r in rows]
    with_other_mates = _picks(engine, [_row((9, 9, 9), 200), *rows[1:3]])[1:]
    assert together == reversed_order == alone
    assert with_other_mates == together[1:3]
    assert together == [synthetic_pick(r.end - 1, r.tokens[-1], ordinary_ids(stories.config))
                        for r in rows]
    # A prefill chunk and a decode row ending on the same position and token pick alike.
    assert _picks(engine, [_row((50, 60, 302), 1)]) == [together[0]]
    # Other positions or tokens move the pick (a constant would pass the checks above).
    assert len(set(_picks(engine, [_row((400,), p) for p in range(8)]))) > 4


def test_picks_are_ordinary_ids_so_requests_never_end_early(stories):
    ids = ordinary_ids(stories.config)
    special = {*stories.config.eos_ids, stories.config.bos_id}
    assert min(ids) == FIRST_ORDINARY_ID and max(ids) == stories.config.vocab_size - 1
    assert not special & set(ids)
    picks = {synthetic_pick(p, t, ids) for p in range(64) for t in range(0, 512, 7)}
    assert picks <= set(ids) and len(picks) > len(ids) // 2
    for pick in picks:
        assert "\ufffd" not in stories.tokenizer.decode([pick])


def test_rows_without_a_spec_pick_nothing_and_from_pick_rows_feed_the_last_launch(stories):
    engine = _engine(stories)
    first = engine.launch(Batch((_row((10, 11), 0), _row((12,), 5), _row((13,), 8, None))))
    fed = engine.launch(Batch((Row((), 6, (0,), sample=SPEC, from_pick=1),
                               Row((), 2, (0,), sample=SPEC, from_pick=0))))
    a, b, none = engine.read(first).picks
    assert none is None and a is not None and b is not None
    ids = ordinary_ids(stories.config)
    assert list(engine.read(fed).picks) == [synthetic_pick(6, b, ids), synthetic_pick(2, a, ids)]
    engine.launch(Batch((_row((13,), 8, None),)))
    with pytest.raises(FailedPrecondition, match="made none"):
        engine.launch(Batch((Row((), 9, (0,), sample=SPEC, from_pick=0),)))


def test_sample_and_logits_give_the_pick_for_the_single_request_calls(stories):
    engine = _engine(stories)
    ids = ordinary_ids(stories.config)
    prompt = [1, 403, 407, 261, 378]
    assert engine.prefill(prompt, 0, [0]) is None
    logits = engine.logits(1)
    assert logits.dtype == np.float32 and logits.shape == (1, stories.config.vocab_size)
    pick = synthetic_pick(4, 378, ids)
    greedy = SampleSpec(temperature=0.0, top_k=0, top_p=1.0)
    assert engine.sample([greedy]) == [int(logits.argmax())] == [pick]
    with pytest.raises(FailedPrecondition, match="had 1 rows"):
        engine.logits(2)


def test_hidden_states_verify_rows_and_bad_options_are_refused(stories):
    with pytest.raises(Unimplemented, match="synthetic engine computes no hidden states"):
        create_engine("synthetic", stories.config, stories.weights).preallocate(
            EnginePlan(max_batch=2, max_seq=64, page_size=16, num_pages=8, hidden_layer=-1))
    engine = _engine(stories)
    with pytest.raises(Unimplemented, match="synthetic engine"):
        engine.prefill([1, 2, 3], 0, [0], capture_hidden=True)
    with pytest.raises(Unimplemented, match="verifies no proposals"):
        engine.launch(Batch((Row((300, 301, 302), 0, (0,), sample=SPEC, verify=2),)))
    with pytest.raises(InvalidArgument, match="engine synthetic does not verify"):
        InferenceRuntime(engine, stories.tokenizer,
                         RuntimeConfig(max_batch=2, max_seq=64, spec=SpecConfig("ngram", 3)))
    for bad in ({"step_ms": -1.0}, {"token_us": math.inf}, {"step_ms": math.nan}):
        with pytest.raises(InvalidArgument, match="must be a finite number >= 0"):
            create_engine("synthetic", stories.config, stories.weights, **bad)


# ---- step time -----------------------------------------------------------------------------

def test_a_read_waits_its_step_time_counted_from_its_launch(stories):
    engine = _engine(stories, step_ms=STEP_S * 1e3)
    t0 = time.perf_counter()
    engine.read(engine.launch(Batch((_row((300,), 0),))))
    assert time.perf_counter() - t0 >= STEP_S
    handle = engine.launch(Batch((_row((300,), 1),)))
    time.sleep(STEP_S)  # the host busy past the step's end: nothing is left to wait for
    t1 = time.perf_counter()
    engine.read(handle)
    assert time.perf_counter() - t1 < STEP_S / 2


def test_each_token_of_a_batch_adds_token_us(stories):
    engine = _engine(stories, step_ms=0.0, token_us=2000.0)
    t0 = time.perf_counter()
    engine.read(engine.launch(Batch((_row(tuple(range(300, 340)), 0), _row((300,), 60)))))
    assert time.perf_counter() - t0 >= 41 * 2e-3


def test_two_launched_steps_run_one_after_the_other(stories):
    engine = _engine(stories, step_ms=STEP_S * 1e3)
    t0 = time.perf_counter()
    first = engine.launch(Batch((_row((300,), 0),)))
    second = engine.launch(Batch((_row((301,), 0),)))
    engine.read(first)
    t_first = time.perf_counter() - t0
    engine.read(second)
    t_second = time.perf_counter() - t0
    assert STEP_S <= t_first < 1.8 * STEP_S
    assert 2 * STEP_S <= t_second < 2.8 * STEP_S


def test_launching_before_reading_the_previous_step_hides_the_host_work(stories):
    """The runtime's order: launch step n+1, turn step n's picks into events, read step n.
    The host's work overlaps the engine's step, so N steps take about N step times, where
    waiting the step time inside `read` would add the host's time to every step."""
    engine = _engine(stories, step_ms=STEP_S * 1e3)
    num_steps, host_s = 4, 0.8 * STEP_S
    t0 = time.perf_counter()
    handle = engine.launch(Batch((_row((300,), 0),)))
    for pos in range(1, num_steps):
        nxt = engine.launch(Batch((Row((), pos, (0,), sample=SPEC, from_pick=0),)))
        time.sleep(host_s)
        engine.read(handle)
        handle = nxt
    engine.read(handle)
    elapsed = time.perf_counter() - t0
    assert elapsed >= num_steps * STEP_S
    assert elapsed < num_steps * STEP_S + (num_steps - 1) * host_s / 2


# ---- the runtime and the stage -------------------------------------------------------------

REQUESTS = [([1, 403, 407, 261, 378], 40), ([1, 300, 301], 25), ([1] + list(range(260, 300)), 30),
            ([1, 450], 50), ([1, 500, 501, 502, 503, 504, 505], 20), ([1, 333], 35)]


def _run(stories: Model, order: list[int], **cfg: int
         ) -> tuple[dict[str, tuple[list[int], str, str]], int]:
    """Each request's (tokens, text, finish reason), and the preemptions it took."""
    rt = InferenceRuntime(create_engine("synthetic", stories.config, stories.weights,
                                        step_ms=0.0), stories.tokenizer,
                          RuntimeConfig(max_seq=512, **cfg))
    rt.preallocate()
    got: dict[str, tuple[list[int], str, str]] = {}
    try:
        for i in order:
            ids, max_tokens = REQUESTS[i]
            rt.submit(GenerationRequest(f"r{i}", ids, resolve(
                rt.config.sampling, max_new_tokens=max_tokens, seed=i)))
        while rt.has_work:
            for ev in rt.step():
                tokens, text, _ = got.get(ev.request_id, ([], "", ""))
                reason = ev.finish_reason.value if ev.finish_reason else ""
                got[ev.request_id] = (tokens + ev.token_ids, text + ev.text, reason)
        return got, rt.scheduler.preemptions
    finally:
        rt.close()


def test_runtime_runs_requests_to_max_tokens_with_the_same_tokens_whatever_the_batch(stories):
    everyone = list(range(len(REQUESTS)))
    together, _ = _run(stories, everyone, max_batch=8)
    for i, (_, max_tokens) in enumerate(REQUESTS):
        tokens, text, reason = together[f"r{i}"]
        assert len(tokens) == max_tokens and reason == FinishReason.MAX_LENGTH.value
        assert text and "\ufffd" not in text
    alone = {}
    for i in everyone:
        alone |= _run(stories, [i], max_batch=1)[0]
    reordered, _ = _run(stories, everyone[::-1], max_batch=3, max_tokens_per_step=8)
    # A pool of 6 pages of 16 for six requests of 2 to 5 pages: some are preempted and
    # recompute, their streams unbroken.
    preempted, num_preemptions = _run(
        stories, everyone, max_batch=6,
        kv_memory_bytes=6 * 16 * create_engine("synthetic", stories.config,
                                               stories.weights).kv_bytes_per_token())
    assert num_preemptions > 0
    assert alone == together == reordered == preempted


def _stage_file(tmp_path, **stage):
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"stages": [{"id": "bench", "runner": "llm.backbone",
                                            "maxSeq": 256, **stage}]}))
    return path


def test_a_synthetic_stage_serves_over_grpc_at_its_step_time(tmp_path, stories):
    config = load_stage_config(_stage_file(tmp_path, engine="synthetic", syntheticStepMs=20,
                                           syntheticTokenUs=5))
    assert config.engine_options() == {"step_ms": 20.0, "token_us": 5.0}
    max_tokens = 12
    with StageServer(config) as srv:
        assert srv.stub.Describe(pb.DescribeRequest()).engine == "synthetic"
        for slot, text in enumerate(("Once upon a time", "The dog")):
            srv.admit_prepare(slot, text=text, temperature=0.8, seed=slot, max_tokens=max_tokens)
        t0 = time.perf_counter()
        out = srv.step([0, 1], credits=64).collect({0, 1})
        elapsed = time.perf_counter() - t0
    # A prefill step, then a step per token after the first: each at least 20 ms.
    assert elapsed >= max_tokens * 0.020
    ids = ordinary_ids(stories.config)
    for slot, text in enumerate(("Once upon a time", "The dog")):
        got = out[slot]
        assert len(got["tokens"]) == max_tokens
        assert got["reason"] == pb.FINISH_REASON_MAX_LENGTH
        prompt = stories.tokenizer.encode(text, add_bos=True)
        expect, last = [], prompt[-1]
        for pos in range(len(prompt) - 1, len(prompt) - 1 + max_tokens):
            last = synthetic_pick(pos, last, ids)
            expect.append(last)
        assert got["tokens"] == expect
        assert got["text"] == stories.tokenizer.decode(expect)


def test_the_synthetic_keys_default_and_reach_only_the_synthetic_engine(tmp_path):
    config = load_stage_config(_stage_file(tmp_path, engine="synthetic"))
    assert config.engine_options() == {"step_ms": 1.0, "token_us": 0.0}
    zero = load_stage_config(_stage_file(tmp_path, engine="synthetic", syntheticStepMs=0))
    assert zero.engine_options() == {"step_ms": 0.0, "token_us": 0.0}
    assert load_stage_config(_stage_file(tmp_path, engine="numpy")).engine_options() == {}


@pytest.mark.parametrize("stage, message", [
    ({"engine": "synthetic", "syntheticStepMs": -1}, "syntheticStepMs: must be a finite "
                                                     "number of milliseconds >= 0, got -1.0"),
    ({"engine": "synthetic", "syntheticStepMs": "fast"}, "syntheticStepMs: must be a float"),
    ({"engine": "synthetic", "syntheticStepMs": True}, "syntheticStepMs: must be a float"),
    ({"engine": "synthetic", "syntheticTokenUs": -0.5}, "syntheticTokenUs: must be a finite "
                                                        "number of microseconds"),
    ({"engine": "numpy", "syntheticStepMs": 5}, "syntheticStepMs: only the 'synthetic' engine"),
    ({"engine": "synthetic", "emits": ["text", "hidden"]}, "computes no hidden states"),
])
def test_bad_synthetic_settings_fail_at_load_naming_the_key(tmp_path, stage, message):
    with pytest.raises(ConfigError, match=message):
        load_stage_config(_stage_file(tmp_path, **stage))


def test_a_nan_step_time_is_refused():
    with pytest.raises(ConfigError, match="syntheticStepMs"):
        StageConfig(engine="synthetic", synthetic_step_ms=math.nan)


def test_cli_generates_the_same_text_every_run_and_refuses_the_key_elsewhere(capsys):
    args = ["generate", "--engine", "synthetic", "--synthetic-step-ms", "0", "--max-tokens",
            "16", "--quiet", "Once upon a time"]
    assert cli_main(args) == 0
    first = capsys.readouterr().out
    assert cli_main(args) == 0
    assert capsys.readouterr().out == first and len(first) > len("Once upon a time\n")
    assert cli_main(["generate", "--engine", "numpy", "--synthetic-step-ms", "1", "x"]) == 2
    assert "need --engine synthetic" in capsys.readouterr().err
