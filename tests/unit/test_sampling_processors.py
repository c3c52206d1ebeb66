"""What comes before a pick and what comes with it, on stories260K: penalties, min-p and token
masks change the picks as stated, log-probabilities are those of the raw logits, prompt
scores those at each prompt position, and the numpy engine, the torch engine's host path and
its device path (the code CUDA runs, here on the CPU) agree."""

from __future__ import annotations

import numpy as np
import pytest

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import Engine, EnginePlan
from llm_runner_svc.engines.batch import (
    MAX_LOGPROBS,
    Batch,
    Penalties,
    Row,
    SampleSpec,
    StepOutput,
    TokenMask,
)
from llm_runner_svc.engines.numpy_processors import (
    allowed_tokens,
    apply_penalties,
    pick_rows,
    token_logprobs,
)
from llm_runner_svc.engines.numpy_sampling import sample_rows
from llm_runner_svc.errors import InvalidArgument

PLAN = EnginePlan(max_batch=4, max_seq=128, page_size=8, num_pages=64, prefill_chunk=5)
ENGINES = {"numpy": ("numpy", {}), "torch": ("torch", {"device": "cpu"}),
           "torch-device": ("torch", {"device": "cpu", "device_sampling": True})}


class AllowSet(TokenMask):
    """Allows the tokens it was given."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    @staticmethod
    def fill(masks, out) -> None:
        allowed = np.zeros((len(masks), out.shape[1] * 32), bool)
        for i, mask in enumerate(masks):
            allowed[i, mask.ids] = True
        out[:] = np.packbits(allowed, axis=1, bitorder="little").view("<i4")


def _engine(stories, kind: str, plan: EnginePlan = PLAN) -> Engine:
    name, options = ENGINES[kind]
    if name == "torch":
        pytest.importorskip("torch")
    engine = create_engine(name, stories.config, stories.weights, **options)
    engine.preallocate(plan)
    return engine


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    return x - peak - np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))


def _prompt(stories) -> list[int]:
    return stories.tokenizer.encode("Once upon a time, a little dragon")


def _rows(ids: list[int], specs: list[SampleSpec], scores: int = 2) -> tuple[Row, ...]:
    """Row i: a prompt of len(ids) - 3 + i tokens on its own pages; the first `scores` rows
    score every position after their first (top i alternatives)."""
    return tuple(Row(tuple(ids[:len(ids) - 3 + i]), 0, tuple(range(16 * i, 16 * i + 16)),
                     sample=spec, score=tuple(ids[1:len(ids) - 3 + i]) if i < scores else (),
                     score_top=2 * i)
                 for i, spec in enumerate(specs))


def _specs(ids: list[int]) -> list[SampleSpec]:
    return [SampleSpec(0.0, 0, 1.0, logprobs=3),
            SampleSpec(0.8, 20, 0.9, uniform=0.3, min_p=0.05, logprobs=MAX_LOGPROBS),
            SampleSpec(1.0, 0, 1.0, uniform=0.7, logprobs=0, mask=AllowSet([5, 100, 200, 31]),
                       penalties=Penalties(0.5, 0.3, 1.3, {5: 2, 100: 1}, frozenset(ids))),
            SampleSpec(0.0, 0, 1.0, mask=AllowSet([31, 77]), logit_bias={77: 3.0})]


@pytest.mark.parametrize("kind", list(ENGINES))
def test_logprobs_are_the_raw_log_softmax(stories, kind):
    engine = _engine(stories, kind)
    try:
        ids = _prompt(stories)
        for spec in (SampleSpec(0.0, 0, 1.0, logprobs=5),
                     SampleSpec(0.9, 0, 1.0, uniform=0.4, logprobs=MAX_LOGPROBS)):
            out = engine.read(engine.launch(Batch((Row(tuple(ids), 0, tuple(range(16)),
                                                       sample=spec),), keep_logits=True)))
            want = _log_softmax(engine.logits(1)[0])
            lp = out.logprobs[0]
            assert lp is not None and lp.token_id == out.picks[0]
            assert abs(lp.logprob - want[lp.token_id]) < 1e-4
            order = np.lexsort((np.arange(want.size), -want))[:spec.logprobs]
            assert [t for t, _ in lp.top] == order.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], want[order], atol=1e-4)
        # processing does not reach the log-probabilities: a bias makes the pick, not its
        # log-probability
        biased = SampleSpec(0.0, 0, 1.0, logit_bias={7: 100.0}, logprobs=0)
        out = engine.read(engine.launch(Batch((Row(tuple(ids), 0, tuple(range(16)),
                                                   sample=biased),), keep_logits=True)))
        assert out.picks[0] == 7
        logits = engine.logits(1)[0].copy()
        if kind != "numpy":  # the torch engine's logits keep the bias it added in place
            logits[7] -= 100.0
        assert abs(out.logprobs[0].logprob - _log_softmax(logits)[7]) < 1e-4
    finally:
        engine.close()


def test_engines_agree_on_picks_logprobs_and_scores(stories):
    ids = _prompt(stories)
    outs: dict[str, StepOutput] = {}
    for kind in ENGINES:
        engine = _engine(stories, kind)
        try:
            outs[kind] = engine.read(engine.launch(Batch(_rows(ids, _specs(ids)))))
        finally:
            engine.close()
    want = outs["numpy"]
    assert want.picks[2] in (5, 100, 200, 31) and want.picks[3] == 77
    assert want.logprobs[3] is None and want.scores[2] is None and want.scores[3] is None
    for kind in ("torch", "torch-device"):
        got = outs[kind]
        assert list(got.picks) == list(want.picks), kind
        for a, b in zip(want.logprobs, got.logprobs, strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
                assert abs(a.logprob - b.logprob) < 1e-4
                np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top],
                                           atol=1e-4)
        for a_row, b_row in zip(want.scores[:2], got.scores[:2], strict=True):
            assert a_row is not None and b_row is not None
            assert [s.token_id for s in a_row] == [s.token_id for s in b_row]
            assert [[t for t, _ in s.top] for s in a_row] == [[t for t, _ in s.top]
                                                              for s in b_row]
            np.testing.assert_allclose([s.logprob for s in a_row],
                                       [s.logprob for s in b_row], atol=1e-4)


@pytest.mark.parametrize("kind, hidden_layer, chunk", [
    ("numpy", None, 5), ("numpy", -1, 3), ("torch", None, 5), ("torch-device", None, 4)])
def test_prompt_scores_are_the_log_softmax_at_each_position(stories, kind, hidden_layer,
                                                            chunk):
    """Against a prefill one position at a time; the prompt is cut into passes of `chunk`
    tokens (on the device path: more scored positions in a step than a pass holds, so part
    of them reach the host early), with a hidden port (the numpy engine's blocked prompt)."""
    ids = _prompt(stories)
    plan = EnginePlan(max_batch=2, max_seq=64, page_size=8, num_pages=16,
                      prefill_chunk=chunk, hidden_layer=hidden_layer)
    engine = _engine(stories, kind, plan)
    try:
        out = check_prompt_scores(engine, ids, 1e-4, capture_hidden=hidden_layer is not None)
        assert out.picks[0] == int(np.argmax(engine.logits(1)[0]))
    finally:
        engine.close()


def check_prompt_scores(engine: Engine, ids: list[int], tolerance: float,
                        capture_hidden: bool = False) -> StepOutput:
    """A prompt row scoring every position after its first (top 3) against the log-softmax
    of a prefill one position at a time (pages 0-7 for that, 8-15 for the row); returns the
    row's step."""
    want = []
    for i, tok in enumerate(ids[:-1]):
        engine.prefill([tok], i, list(range(8)))
        want.append(_log_softmax(engine.logits(1)[0]))
    row = Row(tuple(ids), 0, tuple(range(8, 16)), sample=SampleSpec(0.0, 0, 1.0),
              score=tuple(ids[1:]), score_top=3, prompt_end=len(ids),
              capture_hidden=capture_hidden)
    out = engine.read(engine.launch(Batch((row,))))
    scores = out.scores[0]
    assert scores is not None and [s.token_id for s in scores] == ids[1:]
    for at, (s, lp) in enumerate(zip(scores, want, strict=True)):
        assert abs(s.logprob - lp[ids[at + 1]]) < tolerance, at
        if tolerance < 1e-3:  # (a looser one: near-ties may order differently)
            assert [t for t, _ in s.top] == np.lexsort((np.arange(lp.size), -lp))[:3].tolist()
        assert len(s.top) == 3
    return out


def test_penalties_by_hand():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, -0.5]], np.float32)
    pen = Penalties(presence=0.5, frequency=0.25, repetition=2.0, counts={3: 2, 1: 1},
                    seen=frozenset({2}))
    spec = SampleSpec(0.0, 0, 1.0, penalties=pen)
    got = logits.copy()
    apply_penalties(got, [spec])
    # 3: 3.0 / 2 - (0.25 * 2 + 0.5); 1: -1.0 * 2 - (0.25 + 0.5); 2 (prompt): 0.5 / 2
    want = np.array([[2.0, -2.75, 0.25, 0.5, -0.5]], np.float32)
    np.testing.assert_array_equal(got, want)
    assert sample_rows(logits.copy(), [SampleSpec(0.0, 0, 1.0)]) == [3]
    assert pick_rows(logits.copy(), [spec])[0] == [0]  # 3 fell below 0's 2.0
    torch = pytest.importorskip("torch")
    from llm_runner_svc.engines import torch_sampling

    on_device = torch.from_numpy(logits.copy())
    torch_sampling.apply_penalties(on_device, [spec])
    np.testing.assert_array_equal(on_device.numpy(), want)


def test_min_p_removes_candidates():
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps those of at least 0.1
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    uniforms = np.linspace(0.0, 0.999, 400)
    picks = {pick_rows(logits.copy(), [SampleSpec(1.0, 0, 1.0, float(u), min_p=0.2)])[0][0]
             for u in uniforms}
    assert picks == {0, 1, 2}
    wide = {pick_rows(logits.copy(), [SampleSpec(1.0, 0, 1.0, float(u), min_p=0.7)])[0][0]
            for u in uniforms}
    assert wide == {0}
    torch = pytest.importorskip("torch")
    from llm_runner_svc.engines.torch_sampling import sample_on_device

    specs = [SampleSpec(1.0, 0, 1.0, float(u), min_p=0.2) for u in uniforms]
    host = pick_rows(np.repeat(logits, len(specs), axis=0), specs)[0]
    out = torch.zeros(len(specs), dtype=torch.int64)
    sample_on_device(torch.from_numpy(np.repeat(logits, len(specs), axis=0)), specs, out)
    assert out.tolist() == host


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_mask_keeps_every_pick_in_its_set(stories, kind):
    engine = _engine(stories, kind)
    try:
        ids = _prompt(stories)
        allowed = [11, 40, 300, 301, 511]
        for seed in range(6):
            specs = [SampleSpec(0.0, 0, 1.0, mask=AllowSet(allowed)),
                     SampleSpec(1.5, 0, 1.0, uniform=(seed + 0.5) / 6,
                                mask=AllowSet(allowed)),
                     SampleSpec(1.0, 3, 1.0, uniform=(seed + 0.5) / 6,
                                mask=AllowSet(allowed[:2])),
                     SampleSpec(0.0, 0, 1.0, mask=AllowSet([]))]
            rows = tuple(Row(tuple(ids[:6 + seed]), 0, tuple(range(16 * i, 16 * i + 16)),
                             sample=spec) for i, spec in enumerate(specs))
            out = engine.read(engine.launch(Batch(rows, keep_logits=True)))
            logits = engine.logits(4)
            assert out.picks[0] == allowed[int(np.argmax(logits[0][allowed]))]
            assert out.picks[1] in allowed and out.picks[2] in allowed[:2]
            # a mask that allows nothing is not applied
            assert out.picks[3] == int(np.argmax(logits[3]))
    finally:
        engine.close()


def test_mask_bits_and_top_tokens_on_the_device_match_the_host():
    torch = pytest.importorskip("torch")
    from llm_runner_svc.engines.torch_sampling import apply_mask_words, raw_logprobs

    rng = np.random.default_rng(3)
    vocab = 70
    allowed = rng.random((3, vocab)) < 0.3
    allowed[2] = False  # allows nothing: left alone
    words = np.zeros((3, 3), np.int32)
    AllowSet.fill([AllowSet(np.flatnonzero(a).tolist()) for a in allowed], words)
    np.testing.assert_array_equal(allowed_tokens(words, vocab), allowed)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    logits[:, 5] = logits[:, 9] = logits[:, 2] = 10.0  # ties: the smaller id first
    on_device = torch.from_numpy(logits.copy())
    apply_mask_words(on_device, torch.from_numpy(words))
    want = np.where(allowed, logits, -np.inf)
    want[2] = logits[2]
    np.testing.assert_array_equal(on_device.numpy(), want)
    values = torch.zeros((3, 1 + MAX_LOGPROBS))
    top_ids = torch.zeros((3, MAX_LOGPROBS), dtype=torch.int64)
    tokens = [7, 0, 69]
    raw_logprobs(torch.from_numpy(logits), torch.tensor(tokens), 4, values, top_ids)
    for i, lp in enumerate(token_logprobs(logits, tokens, [4] * 3)):
        assert [t for t, _ in lp.top] == top_ids[i, :4].tolist()
        assert lp.top[0][0] == 2 and lp.top[1][0] == 5
        np.testing.assert_allclose(values[i, :5].numpy(),
                                   [lp.logprob] + [v for _, v in lp.top], atol=1e-5)


def test_out_of_range_asks_are_refused(stories):
    engine = _engine(stories, "numpy")
    try:
        ids = tuple(_prompt(stories))
        for row in (Row(ids, 0, tuple(range(8)), sample=SampleSpec(0.0, 0, 1.0, logprobs=21)),
                    Row(ids, 0, tuple(range(8)), score=ids + (1,), score_top=1),
                    Row(ids[:3], 0, tuple(range(8)), score=ids[1:3], score_top=21)):
            with pytest.raises(InvalidArgument):
                engine.launch(Batch((row,)))
    finally:
        engine.close()


def test_graph_engines_pick_as_numpy_and_give_no_prompt_scores(stories):
    from llm_runner_svc.engines.graph_engine import GraphEngine

    assert GraphEngine.supports_scores is False
    assert GraphEngine.supports_masks and GraphEngine.supports_logprobs
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    ids = _prompt(stories)
    outs = []
    for name in ("numpy", "onnx"):
        engine = create_engine(name, stories.config, stories.weights)
        engine.preallocate(PLAN)
        try:
            outs.append(engine.read(engine.launch(Batch(_rows(ids, _specs(ids), scores=0)))))
            if name == "onnx":
                with pytest.raises(InvalidArgument):
                    engine.launch(Batch(_rows(ids, _specs(ids))))
        finally:
            engine.close()
    want, got = outs
    assert list(got.picks) == list(want.picks)
    for a, b in zip(want.logprobs, got.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
