"""Speculative decoding on the numpy and torch (CPU) engines: greedy output is exactly plain
greedy decoding, alone and beside plain requests, under stop strings, length limits,
cancellation and preemption, and every page goes back to the pool; sampled output is
distributed as plain sampling's."""

from __future__ import annotations

import pytest
from helpers import drain_with_metrics, make_runtime

from llm_runner_svc.engines import create_engine
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)
from llm_runner_svc.runtime.speculative import NgramProposer, accept_greedy

PROMPTS = ("Lily and Tom went to the park. Lily and Tom", "The cat sat", "Once upon a time")
ENGINES = ("numpy", "torch")


def _runtime(model, engine: str = "numpy", **cfg) -> InferenceRuntime:
    """A preallocated runtime on `engine` (torch: float32 on the CPU)."""
    if engine == "numpy":
        return make_runtime(model, **cfg)
    pytest.importorskip("torch")
    rt = InferenceRuntime(create_engine(engine, model.config, model.weights, device="cpu"),
                          model.tokenizer, RuntimeConfig(**cfg))
    rt.preallocate()
    return rt


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(SpecConfig(ngram_max=2, ngram_min=1))
    assert p.propose([5, 6, 7, 8, 1, 5, 6, 9, 1, 5, 6], 3) == [9, 1, 5]
    assert p.propose([1, 2, 3, 4], 3) == []
    assert p.propose([7, 7], 4) == [7]


def test_greedy_acceptance_takes_the_matching_prefix_and_the_targets_token():
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accept_greedy([1, 2, 3], [8, 2, 3, 4]) == [8]


def test_config_is_checked():
    with pytest.raises(InvalidArgument, match="method"):
        SpecConfig(method="tree")
    with pytest.raises(InvalidArgument, match="proposal_tokens"):
        SpecConfig(proposal_tokens=0)


def _requests(stories, rt, **kw):
    return [GenerationRequest(f"r{i}", stories.tokenizer.encode(p, add_bos=True),
                              resolve(rt.config.sampling, temperature=0.0,
                                      max_new_tokens=kw.get("max_new_tokens", 120 - 30 * i)),
                              stop=kw.get("stop", ()), ignore_eos=True,
                              disable_spec_decode=i in kw.get("plain", ()))
            for i, p in enumerate(PROMPTS)]


def _drain(rt, cancel_at=None):
    """Step `rt` until idle (cancelling r0 at step `cancel_at`): each request's tokens, and
    its finish reason and metrics."""
    got, ends, steps = {}, {}, 0
    while rt.has_work:
        steps += 1
        if steps == cancel_at:
            rt.cancel("r0")
        for ev in rt.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                ends[ev.request_id] = (ev.finish_reason, ev.metrics)
    return got, ends


def _run(stories, spec, cancel_at=None, engine="numpy", **kw):
    rt = _runtime(stories, engine, max_batch=kw.pop("max_batch", 4), max_seq=512, spec=spec,
                  **{k: kw.pop(k) for k in ("kv_memory_bytes", "page_size") if k in kw})
    try:
        for req in _requests(stories, rt, **kw):
            rt.submit(req)
        got, ends = _drain(rt, cancel_at)
        assert rt.pages.num_free == rt.pages.num_pages
        return got, ends, rt.scheduler.preemptions
    finally:
        rt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_stories260k_golden_with_ngram(stories, goldens, engine):
    case = goldens["cases"][0]
    rt = _runtime(stories, engine, max_batch=1, max_seq=512, spec=SpecConfig(proposal_tokens=4))
    try:
        req = GenerationRequest("g", case["prompt_token_ids"],
                                resolve(rt.config.sampling, temperature=0.0,
                                        max_new_tokens=int(case["steps"])), ignore_eos=True)
        tokens, last = [], None
        for ev in rt.generate(req):
            tokens += ev.token_ids
            last = ev
        assert tokens == case["generated_token_ids"]
        m = last.metrics
        assert m.accepted_tokens > 0 and m.tokens_per_target_step > 1.0
        assert 0 < m.acceptance_rate <= 1.0
        assert rt.pages.num_free == rt.pages.num_pages
    finally:
        rt.close()


@pytest.mark.parametrize(("engine", "k"), [("numpy", 1), ("numpy", 3), ("numpy", 6),
                                           ("torch", 3)])
def test_mixed_batch_is_token_for_token_plain_greedy(stories, engine, k):
    plain, _, _ = _run(stories, None, engine=engine)
    spec, ends, _ = _run(stories, SpecConfig(proposal_tokens=k), engine=engine, plain=(1,))
    assert spec == plain
    assert ends["r1"][1].proposed_tokens == 0  # decoded plainly
    assert ends["r0"][1].accepted_tokens > 0


def test_stop_strings_and_max_tokens_end_mid_verify(stories):
    plain, plain_ends, _ = _run(stories, None, stop=("Lily",), max_new_tokens=37)
    spec, spec_ends, _ = _run(stories, SpecConfig(proposal_tokens=5), stop=("Lily",),
                              max_new_tokens=37)
    assert spec == plain
    assert {r: e[0] for r, e in spec_ends.items()} == {r: e[0] for r, e in plain_ends.items()}
    assert all(len(t) <= 37 for t in spec.values())


def test_cancel_mid_verify_frees_pages(stories):
    spec, ends, _ = _run(stories, SpecConfig(proposal_tokens=4), cancel_at=6)
    plain, _, _ = _run(stories, None)
    assert ends["r0"][0] is FinishReason.CANCELLED
    assert spec["r1"] == plain["r1"] and spec["r2"] == plain["r2"]
    assert spec["r0"] == plain["r0"][:len(spec["r0"])]


def test_preemption_keeps_greedy_output(stories):
    small = {"kv_memory_bytes": 0, "page_size": 4}
    plain, _, _ = _run(stories, None, max_batch=3, **small)
    rt = make_runtime(stories, max_batch=3, max_seq=512, page_size=4)
    page_bytes = rt.engine.kv_bytes_per_token() * 4
    rt.close()
    tight = {"kv_memory_bytes": page_bytes * 40, "page_size": 4}
    spec, _, preemptions = _run(stories, SpecConfig(proposal_tokens=4), max_batch=3, **tight)
    assert preemptions > 0
    assert spec == plain


def test_spec_with_a_hidden_port_is_refused(stories):
    with pytest.raises(InvalidArgument, match="hidden"):
        make_runtime(stories, max_seq=512, hidden_layer=-1, spec=SpecConfig())


def test_cli_generate_with_ngram_prints_the_plain_greedy_text(capsys):
    from llm_runner_svc.cli import main

    args = ["generate", "Lily and Tom went to the park. Lily and Tom", "--temperature", "0",
            "--max-tokens", "40", "--quiet"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--spec", "ngram", "--proposal-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain


def test_stage_counters_add_up_a_speculative_run():
    from types import SimpleNamespace

    from llm_runner_svc.runtime import RequestMetrics
    from llm_runner_svc.stage.metrics import StageMetrics

    m = RequestMetrics(prompt_tokens=5, generated_tokens=9, proposed_tokens=12,
                       accepted_tokens=6, target_steps=4, verified_tokens=9)
    slot = SimpleNamespace(run=SimpleNamespace(metrics=m, ended=FinishReason.MAX_LENGTH),
                           request=SimpleNamespace(lora=""),
                           telemetry=SimpleNamespace(t_join_ns=1))
    metrics = StageMetrics(lambda: None)
    metrics.run_ended(slot)
    read = metrics.registry.get_sample_value
    assert [read(f"llmstage_spec_{n}_total") for n in (
        "proposed_tokens", "accepted_tokens", "target_steps", "verified_tokens")] == \
        [12.0, 6.0, 4.0, 9.0]
    assert m.acceptance_rate == 0.5 and m.tokens_per_target_step == 2.25


# ---- speculative sampling --------------------------------------------------------------------

def _chi_square(counts, probs) -> tuple[float, float]:
    """Pearson's statistic of `counts` against `probs` (bins with an expected count under 5
    pooled into one) and its critical value at significance 0.001 (Wilson-Hilferty)."""
    n = sum(counts)
    expected = [p * n for p in probs]
    big = [i for i, e in enumerate(expected) if e >= 5]
    rest = [i for i in range(len(probs)) if i not in big]
    obs = [counts[i] for i in big] + ([sum(counts[i] for i in rest)] if rest else [])
    exp = [expected[i] for i in big] + ([sum(expected[i] for i in rest)] if rest else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    k = len(obs) - 1
    z = 3.0902  # the standard normal's 0.999 quantile
    return stat, k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


def test_rejection_rule_draws_from_the_target_whatever_the_proposer():
    import numpy as np

    from llm_runner_svc.engines.numpy_sampling import rejection_pick

    rng = np.random.default_rng(7)
    p = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = np.array([0.40, 0.05, 0.25, 0.05, 0.15, 0.10])
    draws = 20000
    counts = [0] * 6
    naive = [0] * 6  # always accepting: the proposer's distribution
    cq = np.cumsum(q)
    for a, u, d in rng.random((draws, 3)):
        proposed = min(int(np.searchsorted(cq, d, side="right")), 5)
        counts[rejection_pick(p, q, proposed, a, u)] += 1
        naive[proposed] += 1
    stat, crit = _chi_square(counts, p)
    assert stat < crit
    assert _chi_square(naive, p)[0] > crit  # the test tells the two apart


def test_sampled_verify_picks_are_distributed_as_plain_sampling(stories):
    """At each position of a verify row, the pick given the proposed token is distributed
    as plain sampling's pick there (temperature, top-k and top-p applied alike)."""
    import numpy as np

    from llm_runner_svc.engines.batch import SampleSpec
    from llm_runner_svc.engines.numpy_sampling import _nucleus, verify_picks

    rt = make_runtime(stories, max_batch=1, max_seq=64)
    try:
        ids = stories.tokenizer.encode("Lily and Tom went to the park.", add_bos=True)
        rt.engine.prefill(ids, 0, list(range(4)))
        logits = rt.engine.logits(1)[0].copy()
    finally:
        rt.close()
    spec = SampleSpec(1.5, 10, 0.98)
    cand, cum = _nucleus(logits, spec)
    p = np.diff(cum, prepend=0.0) / cum[-1]
    assert cand.shape[0] >= 4  # several tokens in play
    rng = np.random.default_rng(11)
    for proposed in (int(cand[0]), int(cand[3]), int(np.argmin(logits))):
        counts = dict.fromkeys(cand.tolist(), 0)
        for a, u in rng.random((6000, 2)):
            s = SampleSpec(1.5, 10, 0.98, uniform=float(u), accept_uniform=float(a))
            counts[verify_picks(logits[None], [s], [proposed])[0]] += 1
        stat, crit = _chi_square([counts[t] for t in cand.tolist()], p.tolist())
        assert stat < crit, (proposed, stat, crit)


@pytest.mark.parametrize("engine", ENGINES)
def test_sampled_speculation_runs_in_a_mixed_batch(stories, engine):
    """Sampled requests speculate beside greedy and plain ones: greedy outputs stay plain
    greedy, a seeded sampled request repeats itself, proposals get accepted and every
    page comes back."""
    def run(spec):
        rt = _runtime(stories, engine, max_batch=4, max_seq=512, spec=spec)
        try:
            prompt = stories.tokenizer.encode(PROMPTS[0], add_bos=True)
            for i, temp in enumerate((0.0, 0.7, 0.7, 1.0)):
                rt.submit(GenerationRequest(f"r{i}", prompt, resolve(
                    rt.config.sampling, temperature=temp, top_k=20, top_p=0.9, seed=5 + i % 2,
                    max_new_tokens=60), ignore_eos=True, disable_spec_decode=i == 3))
            got, metrics = drain_with_metrics(rt)
            assert rt.pages.num_free == rt.pages.num_pages
            return got, metrics
        finally:
            rt.close()

    plain, _ = run(None)
    first, m1 = run(SpecConfig(proposal_tokens=4))
    again, _ = run(SpecConfig(proposal_tokens=4))
    assert first == again
    assert first["r0"] == plain["r0"] and first["r3"] == plain["r3"]
    assert all(len(t) == 60 for t in first.values())
    assert m1["r1"].proposed_tokens > 0 and m1["r1"].accepted_tokens > 0
    assert m1["r3"].proposed_tokens == 0


# ---- draft engines: self (layer skip) and draft (a second model) ----------------------------

def _draft_runtime(stories, engine, spec, **cfg):
    from llm_runner_svc.engines.drafts import create_draft_engine

    rt = _runtime(stories, engine, max_seq=512, spec=None, **cfg)  # the target, built alike
    target = rt.engine
    draft = create_draft_engine(spec.method, engine, stories, target, spec.draft_layers,
                                spec.draft_checkpoint, **({"device": "cpu"} if engine == "torch"
                                                          else {}))
    rt.close()
    out = InferenceRuntime(target, stories.tokenizer, RuntimeConfig(max_seq=512, spec=spec,
                                                                     **cfg), draft)
    out.preallocate()
    return out


# Layer-skip drafts of the embedded model stay below break-even: the rule that would turn
# them off is off here, where what counts is what they propose and how it is verified.
@pytest.mark.parametrize(("engine", "spec"), [
    ("numpy", SpecConfig("self", 4, draft_layers=2, min_accepted_per_step=0.0)),
    ("torch", SpecConfig("self", 3, draft_layers=3, min_accepted_per_step=0.0)),
    ("numpy", SpecConfig("draft", 4, draft_checkpoint="stories260K")),
    ("torch", SpecConfig("draft", 5, draft_checkpoint="stories260K")),
])
def test_draft_proposers_keep_plain_greedy_output_in_a_mixed_batch(stories, engine, spec):
    plain, _, _ = _run(stories, None, engine=engine)
    rt = _draft_runtime(stories, engine, spec, max_batch=4)
    try:
        for req in _requests(stories, rt, plain=(1,)):
            rt.submit(req)
        got, metrics = _drain(rt)
        assert got == plain
        assert rt.pages.num_free == rt.pages.num_pages
        assert rt.proposer.pool.num_free == rt.proposer.pool.num_pages  # draft pages back
    finally:
        rt.close()
    m = metrics["r0"][1]
    assert metrics["r1"][1].proposed_tokens == 0
    assert m.proposed_tokens > 0 and m.accepted_tokens > 0
    if spec.method == "draft":  # the target as its own draft: every proposal accepted
        assert m.acceptance_rate == 1.0 and m.tokens_per_target_step > spec.proposal_tokens


def test_draft_confidence_threshold_shortens_proposals(stories):
    plain, _, _ = _run(stories, None)
    counts = []
    for threshold in (0.0, 0.9):
        rt = _draft_runtime(stories, "numpy", SpecConfig("self", 4, draft_layers=2,
                                                         confidence_threshold=threshold),
                            max_batch=4)
        try:
            for req in _requests(stories, rt):
                rt.submit(req)
            got, metrics = _drain(rt, cancel_at=None)
        finally:
            rt.close()
        assert got == plain
        counts.append(sum(m.proposed_tokens for _, m in metrics.values()))
    assert counts[1] < counts[0]


def test_cancel_mid_verify_frees_draft_pages(stories):
    rt = _draft_runtime(stories, "numpy", SpecConfig("self", 4, draft_layers=2), max_batch=4)
    try:
        for req in _requests(stories, rt):
            rt.submit(req)
        got, metrics = _drain(rt, cancel_at=5)
        assert metrics["r0"][0] is FinishReason.CANCELLED
        assert rt.proposer.pool.num_free == rt.proposer.pool.num_pages
    finally:
        rt.close()


def test_a_draft_with_another_tokenizer_is_refused_by_name(stories):
    from llm_runner_svc.engines.drafts import create_draft_engine

    rt = make_runtime(stories, max_seq=64)
    try:
        with pytest.raises(InvalidArgument, match="not the target's tokenizer: 49152 token ids"):
            create_draft_engine("draft", "numpy", stories, rt.engine,
                                draft_checkpoint="smollm2")
        with pytest.raises(InvalidArgument, match="draft_layers"):
            create_draft_engine("self", "numpy", stories, rt.engine, draft_layers=9)
    finally:
        rt.close()


@pytest.mark.parametrize("spec", ["self:2", "draft:stories260K"])
def test_cli_generate_with_a_draft_prints_the_plain_greedy_text(capsys, spec):
    from llm_runner_svc.cli import main

    args = ["generate", "Lily and Tom went to the park. Lily and Tom", "--temperature", "0",
            "--max-tokens", "30", "--quiet"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--spec", spec, "--proposal-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain


def test_stage_speculates_with_a_layer_skip_draft_and_honours_disable_spec_decode(goldens):
    """Over real gRPC: a stage configured with `self` speculation serves the golden greedy
    text, reports acceptance in Diagnostics, and a request with disable_spec_decode decodes
    plainly (no speculative keys) with the same tokens."""
    from google.protobuf.json_format import MessageToDict
    from stage_harness import StageServer

    from llm_runner_svc.stage import StageConfig
    from services.contract.llmstage.v1 import stage_pb2 as pb

    case = next(c for c in goldens["cases"] if c["name"] == "greedy_from_bos")
    config = StageConfig(max_seq=512, spec=SpecConfig("self", 4, draft_layers=3))
    diags = {}
    with StageServer(config) as srv:
        for sid, plain in ((1, False), (2, True)):
            srv.admit_prepare(sid, token_ids=case["prompt_token_ids"], temperature=0.0,
                              max_tokens=case["steps"], disable_spec_decode=plain)
            stream = srv.step([sid], credits=64)
            out = stream.collect({sid})[sid]
            assert out["tokens"] == case["generated_token_ids"]
            srv.stub.Finish(pb.FinishRequest(slot_id=sid))
            diags[sid] = MessageToDict(
                srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)).values)
            srv.stub.Reset(pb.ResetRequest(slot_id=sid))
            stream.half_close()
        stage = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest()).values)
        metrics = srv.stage.metrics.registry.get_sample_value
        rate = metrics("llmstage_spec_acceptance_rate")
    assert diags[1]["proposed_tokens"] > 0 and diags[1]["tokens_per_target_step"] > 1.0
    assert 0 < diags[1]["acceptance_rate"] <= 1.0
    assert "proposed_tokens" not in diags[2]
    # stage-wide: the speculative request's counts alone (the plain one adds none)
    for key in ("proposed_tokens", "accepted_tokens", "acceptance_rate",
                "tokens_per_target_step"):
        assert stage[f"spec_{key}"] == pytest.approx(diags[1][key], rel=1e-3), key
    assert rate == pytest.approx(diags[1]["acceptance_rate"], rel=1e-3)


def test_draft_proposals_without_a_row_this_step_are_forgotten(stories):
    """A request whose draft proposed but which got no row that step (the token budget ran
    out, or it was preempted) proposes again from its known tokens: the draft's KV of the
    unverified proposal is not taken as its own."""
    from types import SimpleNamespace

    rt = _draft_runtime(stories, "numpy", SpecConfig("self", 4, draft_layers=2), max_batch=2)
    try:
        seq = SimpleNamespace(req=SimpleNamespace(request_id="a"),
                              known=stories.tokenizer.encode(PROMPTS[0], add_bos=True))
        first = rt.proposer.propose_batch([seq], [4])
        again = rt.proposer.propose_batch([seq], [4])  # no verify row in between
        assert len(first[0]) == 4 and again == first
        rt.proposer.release(seq)
        assert rt.proposer.pool.num_free == rt.proposer.pool.num_pages
    finally:
        rt.close()


def test_a_failing_draft_costs_its_requests_their_proposals_only(stories):
    plain, _, _ = _run(stories, None)
    rt = _draft_runtime(stories, "numpy", SpecConfig("self", 4, draft_layers=2), max_batch=4)
    launch, calls = rt.proposer.engine.launch, []

    def flaky(batch):
        calls.append(1)
        if len(calls) % 7 == 3:
            raise RuntimeError("draft device lost")
        return launch(batch)

    rt.proposer.engine.launch = flaky
    try:
        for req in _requests(stories, rt):
            rt.submit(req)
        got, ends = _drain(rt)
        assert got == plain
        assert all(e[0] is FinishReason.MAX_LENGTH for e in ends.values())
        assert rt.proposer.pool.num_free == rt.proposer.pool.num_pages
    finally:
        rt.close()


@pytest.mark.parametrize(("engine", "spec"), [
    ("numpy", SpecConfig(proposal_tokens=4, max_batch=1)),
    ("torch", SpecConfig(proposal_tokens=3, max_batch=1)),
    ("numpy", SpecConfig("self", 4, draft_layers=2, max_batch=1)),
])
def test_no_proposals_while_more_requests_decode_than_disable_by_batch_size(stories, engine,
                                                                            spec):
    """With disable_by_batch_size 1, the three requests decode plainly while two or three
    run (r2, 60 tokens, never runs alone), and r0 speculates once it is the last; a draft
    catches up on the tokens it skipped. Every output is plain greedy's."""
    plain, _, _ = _run(stories, None, engine=engine)
    if spec.method == "ngram":
        got, ends, _ = _run(stories, spec, engine=engine)
    else:
        rt = _draft_runtime(stories, engine, spec, max_batch=4)
        try:
            for req in _requests(stories, rt):
                rt.submit(req)
            got, ends = _drain(rt)
            assert rt.pages.num_free == rt.pages.num_pages
        finally:
            rt.close()
    assert got == plain
    assert ends["r2"][1].proposed_tokens == 0
    assert ends["r0"][1].proposed_tokens > 0
    with pytest.raises(InvalidArgument, match="disable_by_batch_size"):
        SpecConfig(max_batch=-1)
