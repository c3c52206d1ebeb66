"""Runtime behaviour: lifecycle, finish reasons, cancellation, bad input, metrics."""

from __future__ import annotations

import math

import pytest
from helpers import make_runtime

from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    SamplingDefaults,
    SamplingParams,
    resolve,
)


def _req(model, rid="r", prompt="Once upon a time", **kw):
    stop = kw.pop("stop", ())
    capture = kw.pop("capture_hidden", False)
    sampling = resolve(SamplingDefaults(), **kw)
    return GenerationRequest(rid, model.tokenizer.encode(prompt), sampling, stop=stop,
                             capture_hidden=capture)


def _drain(rt):
    out = {}
    while rt.has_work:
        for ev in rt.step():
            tokens, text, last = out.get(ev.request_id, ([], "", None))
            out[ev.request_id] = (tokens + ev.token_ids, text + ev.text, ev)
    return out


def test_defaults_are_the_seeds_and_requests_override_them():
    d = SamplingDefaults()
    assert (d.max_generate_length, d.temperature, d.top_p, d.top_k) == (256, 1.0, 0.8, 50)
    p = resolve(d, temperature=0.5, top_k=3)
    assert (p.temperature, p.top_k, p.top_p, p.max_new_tokens) == (0.5, 3, 0.8, 256)


def test_max_new_tokens_ends_with_max_length(runtime, stories):
    out = _drain_one(runtime, _req(stories, temperature=0.0, max_new_tokens=7))
    tokens, _, last = out
    assert len(tokens) == 7
    assert last.finish_reason is FinishReason.MAX_LENGTH
    assert last.metrics.generated_tokens == 7
    assert last.metrics.prompt_tokens == len(stories.tokenizer.encode("Once upon a time"))
    assert last.metrics.prefill_ms > 0 and last.metrics.decode_ms > 0
    assert last.metrics.tokens_per_s > 0


def _drain_one(rt, req):
    rt.submit(req)
    return _drain(rt)[req.request_id]


def test_generation_stops_at_max_seq(stories):
    rt = make_runtime(stories, max_batch=2, max_seq=32)
    prompt_len = len(stories.tokenizer.encode("Once upon a time"))
    tokens, _, last = _drain_one(rt, _req(stories, temperature=0.0, max_new_tokens=500))
    assert last.finish_reason is FinishReason.MAX_LENGTH
    assert prompt_len + len(tokens) == 32 + 1  # the last sampled token needs no KV slot
    assert rt.pages.num_free == rt.plan.num_pages


def test_stop_string_truncates_text_and_ends_request(runtime, stories):
    _, full, _ = _drain_one(runtime, _req(stories, "a", temperature=0.0, max_new_tokens=60))
    word = "Lily"
    assert word in full
    tokens, text, last = _drain_one(
        runtime, _req(stories, "b", temperature=0.0, max_new_tokens=60, stop=(word,)))
    assert last.finish_reason is FinishReason.STOP_WORDS
    assert text == full[:full.index(word)]


def test_eos_ends_with_end_of_sequence(runtime, stories):
    # a large bias makes the end-of-text token the only choice after the prompt
    eos = stories.tokenizer.eos_ids[0]
    tokens, text, last = _drain_one(
        runtime, _req(stories, temperature=0.0, logit_bias={eos: 1e4}))
    assert tokens == [] and text == ""
    assert last.finish_reason is FinishReason.END_OF_SEQUENCE


def test_logit_bias_forces_a_token(runtime, stories):
    tokens, _, _ = _drain_one(
        runtime, _req(stories, temperature=0.9, max_new_tokens=5, logit_bias={300: 1e4}))
    assert tokens == [300] * 5


def test_cancel_lands_at_next_step_and_frees_pages(runtime, stories):
    runtime.submit(_req(stories, "a", max_new_tokens=200))
    runtime.submit(_req(stories, "b", max_new_tokens=30, temperature=0.0))
    for _ in range(3):
        runtime.step()
    assert runtime.cancel("a")
    events = {ev.request_id: ev for ev in runtime.step()}
    assert events["a"].finish_reason is FinishReason.CANCELLED
    assert events["a"].token_ids == []  # no token after the cancel was observed
    assert events["b"].finish_reason is None and len(events["b"].token_ids) == 1
    rest = _drain(runtime)
    assert rest["b"][2].finish_reason is FinishReason.MAX_LENGTH
    assert runtime.pages.num_free == runtime.plan.num_pages
    assert not runtime.cancel("a")  # gone


def test_cancel_before_prefill(runtime, stories):
    runtime.submit(_req(stories, "w"))
    runtime.cancel("w")
    events = runtime.step()
    assert [(e.request_id, e.finish_reason, e.token_ids) for e in events] == [
        ("w", FinishReason.CANCELLED, [])]
    assert runtime.pages.num_free == runtime.plan.num_pages


def test_finish_reason_is_latched_first_writer_wins(runtime, stories):
    runtime.submit(_req(stories, "a", temperature=0.0, max_new_tokens=1))
    runtime.cancel("a")  # observed at the top of the step, before the prefill could end it
    (ev,) = runtime.step()
    assert ev.finish_reason is FinishReason.CANCELLED


def test_waiting_requests_join_when_rows_free(stories):
    rt = make_runtime(stories, max_batch=2, max_seq=128)
    for i in range(5):
        rt.submit(_req(stories, f"q{i}", temperature=0.0, max_new_tokens=3 + i))
    first = {ev.request_id: len(ev.token_ids) for ev in rt.step()}
    assert rt.num_running == 2 and rt.num_waiting == 3
    assert first == {"q0": 1, "q1": 1}
    out = _drain(rt)
    lengths = {rid: len(t) + first.get(rid, 0) for rid, (t, _, _) in out.items()}
    assert lengths == {"q0": 3, "q1": 4, "q2": 5, "q3": 6, "q4": 7}
    assert all(ev.finish_reason is FinishReason.MAX_LENGTH for _, _, ev in out.values())


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_tokens must be positive"),
    (dict(logit_bias={5: math.nan}), "logit_bias"),
])
def test_bad_sampling_values_are_refused(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        resolve(SamplingDefaults(), **kw)


def test_bad_requests_are_refused_and_runtime_stays_usable(stories):
    rt = make_runtime(stories, max_batch=2, max_seq=64, max_waiting=2)
    sampling = SamplingParams(0.0, 1, 1.0, 4)
    with pytest.raises(InvalidArgument, match="empty"):
        GenerationRequest("e", [], sampling)
    with pytest.raises(InvalidArgument, match="maxSeq is 64"):
        rt.submit(GenerationRequest("long", [1] + [300] * 70, sampling))
    for bad in ([1, 9999], [1, -1], [1, 2**32], [1, 2**40], [1, 2.0]):
        with pytest.raises(InvalidArgument, match="outside"):
            rt.submit(GenerationRequest("oov", bad, sampling))
        assert isinstance(rt.admission_error(GenerationRequest("oov", bad, sampling)),
                          InvalidArgument)
    with pytest.raises(FailedPrecondition, match="hidden"):
        rt.submit(GenerationRequest("h", [1], sampling, capture_hidden=True))
    rt.submit(GenerationRequest("ok", [1, 403], sampling))
    with pytest.raises(FailedPrecondition, match="already in flight"):
        rt.submit(GenerationRequest("ok", [1, 403], sampling))
    rt.submit(GenerationRequest("ok2", [1, 403], sampling))
    with pytest.raises(ResourceExhausted, match="queue is full"):
        rt.submit(GenerationRequest("ok3", [1, 403], sampling))
    assert rt.pages.num_free == rt.plan.num_pages  # refusals allocated nothing
    out = _drain(rt)
    assert len(out["ok"][0]) == 4 and out["ok"][0] == out["ok2"][0]


def test_runtime_refuses_use_before_preallocate(stories):
    from llm_runner_svc.engines import create_engine
    from llm_runner_svc.runtime import InferenceRuntime, RuntimeConfig

    rt = InferenceRuntime(create_engine("numpy", stories.config, stories.weights),
                          stories.tokenizer, RuntimeConfig())
    with pytest.raises(FailedPrecondition, match="preallocate"):
        rt.submit(_req(stories))


def test_unknown_engine_lists_valid_ones(stories):
    from llm_runner_svc.engines import create_engine

    with pytest.raises(InvalidArgument, match="valid engines: numpy"):
        create_engine("tensorflow", stories.config, stories.weights)


def test_a_cancelled_row_is_refilled_in_the_same_step(stories):
    rt = make_runtime(stories, max_batch=1, max_seq=64)
    rt.submit(_req(stories, "a", max_new_tokens=50))
    rt.submit(_req(stories, "b", temperature=0.0, max_new_tokens=50))
    rt.step()
    assert rt.num_running == 1 and rt.num_waiting == 1
    rt.cancel("a")
    events = {ev.request_id: ev for ev in rt.step()}
    assert events["a"].finish_reason is FinishReason.CANCELLED
    assert len(events["b"].token_ids) == 1  # prefilled in the row "a" left
    assert rt.num_running == 1 and rt.num_waiting == 0
    rt.close()
