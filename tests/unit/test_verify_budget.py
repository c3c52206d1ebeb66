"""The per-step verify budget of speculative decoding (`spec_decode.max_verify_tokens`): the
verify rows of every batch the engine receives hold at most that many tokens, proposals are
cut evenly to fit (requests past the budget decode plainly), greedy output stays plain
greedy's, the proposed-token counts match what was verified, and 0 keeps every K whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from helpers import drain_with_metrics

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.batch import Batch
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)
from llm_runner_svc.runtime.speculative import StatelessProposer, verify_shares

PROMPTS = ("Lily and Tom went to the park. Lily and Tom", "The cat sat", "Once upon a time",
           "Tom had a big red ball. Tom")


def test_shares_split_the_budget_evenly_between_the_oldest_requests():
    assert verify_shares([4] * 12, 1, 64) == [4] * 12  # 60 tokens: within the budget
    assert verify_shares([4] * 13, 1, 64) == [4] * 12 + [3]  # 64 = 12 x 5 + 4
    assert verify_shares([4] * 32, 1, 64) == [1] * 32  # 32 rows of 2 tokens
    assert verify_shares([4] * 40, 1, 64) == [1] * 32 + [0] * 8  # the newest decode plainly
    assert verify_shares([4] * 32, 2, 64) == [3] + [2] * 20 + [0] * 11  # min_proposal 2
    assert verify_shares([4, 1, 4], 1, 8) == [2, 1, 1]  # a request's own limit stays
    assert verify_shares([4] * 3, 1, 1) == [0, 0, 0]  # too small for one verify row
    assert verify_shares([4] * 100, 1, 0) == [4] * 100  # 0: no budget


def test_a_negative_budget_is_refused():
    with pytest.raises(InvalidArgument, match="spec_decode.max_verify_tokens must be 0 or more"):
        SpecConfig(max_verify_tokens=-1)


def _runtime(stories, engine: str, spec: SpecConfig, max_batch: int) -> InferenceRuntime:
    """A preallocated runtime on `engine` (torch: float32 on the CPU; a `self` spec gets its
    layer-skip draft), with a step token budget no verify row here reaches."""
    cfg = RuntimeConfig(max_batch=max_batch, max_seq=512, max_tokens_per_step=256, spec=spec)
    if engine == "torch":
        pytest.importorskip("torch")
    kw = {"device": "cpu"} if engine == "torch" else {}
    target = create_engine(engine, stories.config, stories.weights, **kw)
    draft = None
    if spec.method != "ngram":
        from llm_runner_svc.engines.drafts import create_draft_engine

        draft = create_draft_engine(spec.method, engine, stories, target, spec.draft_layers,
                                    spec.draft_checkpoint, **kw)
    rt = InferenceRuntime(target, stories.tokenizer, cfg, draft)
    rt.preallocate()
    return rt


class ScriptedProposer(StatelessProposer):
    """Always proposes all it is asked for: the plain greedy continuation with every third
    token wrong, so steps accept and reject and every proposal is as long as its share."""

    def __init__(self, config: SpecConfig, plain: dict[str, list[int]]) -> None:
        super().__init__(config)
        self.plain = plain

    def propose_batch(self, seqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            done = len(seq.output_ids)
            out.append([t if (done + j) % 3 else t + 1 for j, t in
                        enumerate(self.plain[seq.req.request_id][done:done + k])])
        return out


def _run(stories, engine: str, spec: SpecConfig | None, num: int,
         scripted: dict[str, list[int]] | None = None):
    """`num` greedy requests (the prompts in turn, 40 tokens each) in one batch, proposing
    with a ScriptedProposer over `scripted` when given: each one's tokens and metrics, and
    the batches the target engine received."""
    rt = _runtime(stories, engine, spec or SpecConfig(), num)
    if scripted is not None:
        assert spec is not None
        rt.proposer = ScriptedProposer(spec, scripted)  # type: ignore[assignment]
    batches: list[Batch] = []
    launch = rt.engine.launch

    def recording(batch: Batch, *args, **kwargs):
        batches.append(batch)
        return launch(batch, *args, **kwargs)

    rt.engine.launch = recording  # type: ignore[method-assign]
    try:
        for i in range(num):
            ids = stories.tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_bos=True)
            rt.submit(GenerationRequest(f"r{i}", ids, resolve(
                rt.config.sampling, temperature=0.0, max_new_tokens=40), ignore_eos=True,
                disable_spec_decode=spec is None))
        got, metrics = drain_with_metrics(rt)
        assert rt.pages.num_free == rt.pages.num_pages
        return got, metrics, batches
    finally:
        rt.close()


def _verify_tokens(batch: Batch) -> int:
    return sum(len(row.tokens) for row in batch.rows if row.verify)


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_every_step_verifies_within_its_budget_at_sixteen_requests(stories, engine):
    """16 requests proposing K = 4 would verify 80 tokens a step; under a budget of 64
    each verifies 3, and the output is plain greedy's."""
    plain, _, _ = _run(stories, engine, None, 16)
    spec = SpecConfig(proposal_tokens=4, max_verify_tokens=64)
    got, metrics, batches = _run(stories, engine, spec, 16, scripted=plain)
    assert got == plain
    assert max(_verify_tokens(b) for b in batches) <= 64
    full = [b for b in batches if len(b.rows) == 16 and all(r.verify for r in b.rows)]
    assert full and all(r.verify <= 3 for b in full for r in b.rows)  # 2 at the length limit
    assert sum(all(r.verify == 3 for r in b.rows) for b in full) >= len(full) - 1
    _check_counts(metrics, batches)
    _, _, unlimited = _run(stories, engine, dataclasses.replace(spec, max_verify_tokens=0), 16,
                           scripted=plain)
    assert max(_verify_tokens(b) for b in unlimited) == 80  # what the budget cut


@pytest.mark.parametrize(("engine", "spec"), [
    ("numpy", SpecConfig(proposal_tokens=4, max_verify_tokens=5)),  # two verify rows
    ("torch", SpecConfig(proposal_tokens=3, max_verify_tokens=6)),
    ("numpy", SpecConfig("self", 4, draft_layers=2, max_verify_tokens=7,
                         min_accepted_per_step=0.0)),  # below break-even, kept on
])
def test_real_proposers_keep_plain_greedy_output_within_a_small_budget(stories, engine, spec):
    plain, _, _ = _run(stories, engine, None, 4)
    got, metrics, batches = _run(stories, engine, spec, 4)
    assert got == plain
    assert max(_verify_tokens(b) for b in batches) <= spec.max_verify_tokens
    _check_counts(metrics, batches)
    assert sum(m.accepted_tokens for m in metrics.values()) > 0


def _check_counts(metrics, batches) -> None:
    """The counts are those of the cut proposals: every proposed token verified once."""
    assert sum(m.proposed_tokens for m in metrics.values()) == \
        sum(row.verify for b in batches for row in b.rows) > 0


def test_past_the_budget_the_newest_requests_decode_plainly(stories):
    """Budget 5 with four requests and K 4: the two oldest verify (3 + 2 tokens), the
    others get one-token rows while all four decode."""
    plain, _, _ = _run(stories, "numpy", None, 4)
    spec = SpecConfig(proposal_tokens=4, max_verify_tokens=5)
    got, _, batches = _run(stories, "numpy", spec, 4, scripted=plain)
    assert got == plain
    decoding = [b for b in batches if len(b.rows) == 4 and b.rows[0].verify]
    assert decoding
    for b in decoding:  # rows follow the requests' age
        assert [r.verify for r in b.rows] == [2, 1, 0, 0]


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_budget_zero_verifies_every_proposal_whole(stories, engine):
    """0 is no budget: the same batches as a budget no step reaches, with whole K verify
    rows beside each other (more tokens than the default budget would cut to)."""
    plain, _, _ = _run(stories, engine, None, 4)
    unlimited = _run(stories, engine, SpecConfig(proposal_tokens=4, max_verify_tokens=0), 4,
                     scripted=plain)
    huge = _run(stories, engine, SpecConfig(proposal_tokens=4, max_verify_tokens=10_000), 4,
                scripted=plain)
    assert unlimited[0] == huge[0]
    assert [[r.tokens for r in b.rows] for b in unlimited[2]] == \
        [[r.tokens for r in b.rows] for b in huge[2]]
    assert unlimited[0] == plain
    assert max(_verify_tokens(b) for b in unlimited[2]) == 20  # 4 requests x (4 + 1)


def test_the_default_budget_leaves_small_batches_as_they_were(stories):
    """Unset, the budget is 256 tokens: four requests at K 4 (20 tokens) never reach it, so
    every batch is the one without a budget."""
    assert SpecConfig().max_verify_tokens == 256
    plain, _, _ = _run(stories, "numpy", None, 4)
    default = _run(stories, "numpy", SpecConfig(proposal_tokens=4), 4, scripted=plain)
    unlimited = _run(stories, "numpy", SpecConfig(proposal_tokens=4, max_verify_tokens=0), 4,
                     scripted=plain)
    assert [[r.tokens for r in b.rows] for b in default[2]] == \
        [[r.tokens for r in b.rows] for b in unlimited[2]]
