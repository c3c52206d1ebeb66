"""The scheduler: who runs in the next step, and with how many tokens. Pure Python.

It owns the waiting queue, the running set (at most `max_batch` requests, each holding a
batch row) and the page pool. Every step, `schedule` builds one batch under a token budget:

1. a decode row (one token) for every running request whose tokens are all computed, oldest
   first; a row that needs a page the pool lacks takes it back from the newest running
   request without a row in this batch (preemption: its pages are freed and it goes back to
   the front of the queue to recompute its prompt and outputs), or, when there is none,
   from the request itself;
2. the next prefill chunk of every running request still prefilling, as much as the budget
   and the free pages allow;
3. while rows, budget and pages last (and nothing was preempted this step), waiting
   requests join with their first chunk, so several short prompts prefill in one forward.

A long prompt is thus spread over several steps beside the decodes (chunked prefill). A
row's last position gets a pick when it is the request's last known token; a decode row may
feed the pick of the previous forward still on the engine (`Row.from_pick`), which is how
the runtime launches step n+1 before it reads step n.

With a prefix cache (prefix_cache.py), a request joining with no pages first takes the
longest cached prefix of its known tokens and prefills only the rest; every planned row
names the full pages it completes, and a request that ends names its last full pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set
from typing import Any

from llm_runner_svc.engines.batch import HiddenStates, Row
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.prefix_cache import PrefixCache, window
from llm_runner_svc.runtime.request import SeqStatus, SequenceState
from llm_runner_svc.runtime.speculative import verify_shares

Planned = list[tuple[SequenceState, Row]]


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_tokens: int, max_seq: int,
                 cache: PrefixCache | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_seq = max_seq
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.launches = 0  # batches handed out; a pick is named by (launch, row)
        self._proposed: dict[int, list[int]] = {}  # this step's proposals, by id(seq)
        self.preemptions = 0
        self._admitted = 0

    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def drop(self, seq: SequenceState) -> None:
        """`seq` ended: out of the queue or the running set, its pages back in the pool."""
        if seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED):
            self.waiting.remove(seq)
        elif seq.status is not SeqStatus.FINISHED:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._commit(seq, self.launches)
        self.pool.release(seq.pages)
        if seq.proposer is not None:
            seq.proposer.release(seq)

    def clear(self) -> None:
        for seq in (*self.running, *self.waiting):
            self.pool.release(seq.pages)
            if seq.proposer is not None:
                seq.proposer.release(seq)
        self.running.clear()
        self.waiting.clear()
        if self.cache is not None:
            self.cache.clear()

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, held: Set[str] = frozenset()) -> Planned:
        """The rows of the next forward (empty: nothing to run). Commits what it plans:
        pages are allocated and each request's computed positions advance."""
        plan: Planned = []
        budget = self.max_tokens
        preempted = self.preemptions
        self._proposed = self._propose(held)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is SeqStatus.DECODING and self._may_step(seq, held):
                budget -= self._decode(seq, plan, budget)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is SeqStatus.PREFILLING and self._may_step(seq, held):
                budget -= self._chunk(seq, budget, plan)
        if self.preemptions == preempted:
            budget = self._admit(budget, held, plan)
        if plan:
            self.launches += 1
        return plan

    @staticmethod
    def _may_step(seq: SequenceState, held: Set[str]) -> bool:
        return not seq.stash and seq.req.request_id not in held

    def _decode(self, seq: SequenceState, plan: Planned, budget: int) -> int:
        """A one-token row for `seq` (a verify row when it proposes), or none at its length
        limits; tokens used."""
        index = len(seq.output_ids) + seq.pending
        if index >= seq.req.sampling.max_new_tokens or seq.computed >= self.max_seq:
            return 0
        if seq.pending:
            if seq.pick_launch != self.launches or seq.reads_first:
                return 0  # its pick is not the last forward's, or it needs it read first
            tokens: tuple[int, ...] = ()
            from_pick: int | None = seq.pick_row
        else:
            tokens, from_pick = tuple(seq.known[seq.computed:seq.computed + 1]), None
            tokens += self._proposal(seq, index, budget)
        if not self._grow(seq, seq.computed + len(tokens or (0,)), plan):
            self.preempt(seq)
            return 0
        self._plan_row(seq, plan, tokens, from_pick, pick=True)
        self._commit(seq, self.launches + 1)
        return len(tokens or (0,))

    def _proposal(self, seq: SequenceState, index: int, budget: int) -> tuple[int, ...]:
        """Tokens a speculative request proposes after its last known one, no more than its
        length limits, the budget and the free pages allow (a verify row)."""
        if seq.proposer is None:
            return ()
        room = (len(seq.pages) + self.pool.num_free) * self.pool.page_size - seq.computed - 1
        k = min(seq.proposer.config.proposal_tokens, budget - 1, room,
                seq.req.sampling.max_new_tokens - index - 1, self.max_seq - seq.computed - 1)
        if k <= 0:
            return ()
        proposal = tuple(self._proposed.get(id(seq), ())[:k])
        if seq.matcher is not None:  # what the constraint would refuse is not verified
            proposal = proposal[:seq.matcher.valid_prefix(proposal)]
        if len(proposal) < seq.proposer.config.min_proposal:
            return ()
        seq.metrics.proposed_tokens += len(proposal)
        return proposal

    def _propose(self, held: Set[str]) -> dict[int, list[int]]:
        """The proposals of every speculative request that decodes this step, asked of each
        proposer at once (a draft model runs them as one batch per draft step), as long as
        their length limits and the step's verify budget (`max_verify_tokens`) allow;
        `_proposal` cuts them to the token budget and the pages."""
        groups: dict[int, tuple[Any, list[SequenceState], list[int]]] = {}
        decoding = sum(seq.status is SeqStatus.DECODING for seq in self.running)
        wanted: list[tuple[SequenceState, int]] = []
        for seq in self.running:
            if seq.proposer is None or seq.status is not SeqStatus.DECODING or seq.pending \
                    or not self._may_step(seq, held):
                continue
            if 0 < seq.proposer.config.max_batch < decoding:
                continue  # too many decode together: plain rows cost less than verify rows
            k = min(seq.proposer.config.proposal_tokens, self.max_seq - seq.computed - 1,
                    seq.req.sampling.max_new_tokens - len(seq.output_ids) - 1)
            if k > 0:
                wanted.append((seq, k))
        if wanted:  # every speculative request of a runtime shares its one config
            config = wanted[0][0].proposer.config
            shares = verify_shares([k for _, k in wanted], config.min_proposal,
                                   config.max_verify_tokens)
            for (seq, _), k in zip(wanted, shares, strict=True):
                _, seqs, ks = groups.setdefault(id(seq.proposer), (seq.proposer, [], []))
                seqs.append(seq)
                ks.append(k)
        out: dict[int, list[int]] = {}
        for proposer, seqs, ks in groups.values():
            for seq, proposal in zip(seqs, proposer.propose_batch(seqs, ks), strict=True):
                out[id(seq)] = proposal
        return out

    def _chunk(self, seq: SequenceState, budget: int, plan: Planned) -> int:
        """The next prefill chunk of `seq`, cut to the budget and the free pages."""
        ps = self.pool.page_size
        room = (len(seq.pages) + self.pool.num_free) * ps - seq.computed
        n = min(len(seq.known) - seq.computed, budget, room)
        if n <= 0:
            return 0
        self._grow(seq, seq.computed + n, plan)
        tokens = tuple(seq.known[seq.computed:seq.computed + n])
        self._plan_row(seq, plan, tokens, None, pick=seq.computed + n == len(seq.known))
        seq.metrics.prefilled_tokens += n
        self._commit(seq, self.launches + 1)
        return n

    def _admit(self, budget: int, held: Set[str], plan: Planned) -> int:
        """Waiting requests join while rows, budget and pages last; pages for one more
        token per decoding request stay free, so a join does not force a preemption."""
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_batch:
                break
            if seq.pending or not self._may_step(seq, held):
                continue
            self._reuse(seq)
            n = min(len(seq.known) - seq.computed, budget)
            decoding = sum(1 for s in self.running if s.status is SeqStatus.DECODING)
            if self.pool.pages_for(seq.computed + n) - len(seq.pages) + decoding > \
                    self.pool.num_free:
                self.pool.release(seq.pages)
                seq.computed = 0
                seq.page_keys, seq.reused_hidden = [], []
                break
            self.waiting.remove(seq)
            if self.cache is not None:
                self.cache.count(seq.computed)
            if seq.status is SeqStatus.WAITING:
                self._admitted += 1
                seq.order = self._admitted
                seq.metrics.cached_tokens = seq.computed
            seq.status = SeqStatus.PREFILLING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.order)
            budget -= self._chunk(seq, n, plan)
        return budget

    def _reuse(self, seq: SequenceState) -> None:
        """A joining request holds the longest cached prefix of its known tokens (unless it
        bypasses the cache); one that captures hidden states takes only pages that kept
        theirs, and receives them as its first states."""
        if self.cache is None or not seq.req.cache_lookup or seq.prompt_scores is not None:
            return  # (prompt log-probabilities need the whole prompt computed)
        hidden = seq.req.capture_hidden
        if hidden and not self.cache.max_snapshots:
            return
        seq.pages, seq.page_keys = self.cache.match(seq.known, self.launches, hidden,
                                                     seq.req.adapter, seq.req.embeds,
                                                     seq.packed_prompt)
        seq.computed = len(seq.pages) * self.pool.page_size
        if hidden:
            seq.reused_hidden = self.cache.pieces(seq.page_keys)

    def keep_hidden(self, seq: SequenceState, hs: HiddenStates) -> None:
        """`hs` was delivered to `seq`: full named pages whose states are all delivered keep
        them in the cache."""
        if self.cache is None or not self.cache.max_snapshots:
            return
        ps = self.pool.page_size
        seq.kept_rows.append(hs)
        full = min(len(seq.page_keys), seq.hidden_upto // ps)
        while seq.kept_pages < full:
            j = seq.kept_pages
            self.cache.attach(seq.page_keys[j], window(seq.kept_rows, j * ps, (j + 1) * ps))
            seq.kept_pages += 1
        lo = seq.kept_pages * ps
        seq.kept_rows = [h for h in seq.kept_rows if h.start_position + len(h.states) > lo]

    def _commit(self, seq: SequenceState, launch: int) -> None:
        """Name the full pages of `seq` whose tokens are known and computed (not those of a
        request scoring its prompt: its passes may round differently from plain prefill)."""
        if self.cache is None or seq.prompt_scores is not None:
            return
        upto = min(seq.computed, len(seq.known))
        if not seq.req.cache_generated:
            upto = min(upto, len(seq.req.prompt_ids))
        self.cache.commit(seq.known, seq.pages, seq.page_keys, upto, launch, seq.req.adapter,
                          seq.req.embeds, seq.packed_prompt)

    def _plan_row(self, seq: SequenceState, plan: Planned, tokens: tuple[int, ...],
                  from_pick: int | None, pick: bool) -> None:
        start = seq.computed
        index = len(seq.output_ids) + seq.pending  # of the row's first output token
        verify = len(tokens) - 1 if seq.proposer is not None and seq.status is \
            SeqStatus.DECODING else 0
        verify = max(verify, 0)
        spec = seq.spec(index + verify) if pick else None
        samples = () if spec is None or spec.is_greedy else \
            tuple(seq.spec(index + j, is_proposed=True) for j in range(verify))
        if verify and spec is not None and seq.matcher is not None:
            # each position's mask: the constraint past the proposed tokens before it
            forks = seq.matcher.forks(tokens[1:])
            samples = tuple(seq.spec(index + j, is_proposed=True, mask=forks[j])
                            for j in range(verify))
            spec = seq.spec(index + verify, mask=forks[verify])
        n = len(seq.req.prompt_ids)
        embeds = seq.req.embeds if tokens and start < n else ()
        score: tuple[int, ...] = ()
        if seq.prompt_scores is not None and tokens:
            # the prompt token after each of its positions (a recompute scores again; the
            # positions scored before are dropped when it is read)
            score = tuple(seq.req.prompt_ids[start + 1:min(start + len(tokens), n - 1) + 1])
        row = Row(tokens, start, seq.pages, spec, seq.req.capture_hidden, from_pick, n, verify,
                  seq.req.adapter, embeds, samples, score,
                  seq.req.sampling.prompt_logprobs or 0)
        seq.computed = row.end
        if pick:
            seq.pending += 1
            seq.pick_launch, seq.pick_row = self.launches + 1, len(plan)
            seq.status = SeqStatus.DECODING
        plan.append((seq, row))

    def _grow(self, seq: SequenceState, end: int, plan: Planned) -> bool:
        """Pages for positions up to `end`, preempting newer requests without a row in
        `plan` while the pool is short. False when it stays short."""
        need = self.pool.pages_for(end) - len(seq.pages)
        while need > self.pool.num_free:
            in_plan = {id(s) for s, _ in plan}
            victims = [s for s in self.running if s is not seq and id(s) not in in_plan]
            if not victims:
                return False
            self.preempt(victims[-1])
        if need > 0:
            seq.pages.extend(self.pool.allocate(need))
        return True

    def roll_back(self, seq: SequenceState, computed: int) -> None:
        """A verify row's rejected positions are not computed after all: `seq` counts
        `computed` positions and gives back the pages past them (their KV is stale)."""
        seq.computed = computed
        keep = self.pool.pages_for(computed)
        if len(seq.pages) > keep:
            tail = seq.pages[keep:]
            del seq.pages[keep:]
            self.pool.release(tail)

    def preempt(self, seq: SequenceState) -> None:
        """Take `seq`'s pages back; it waits at the front of the queue and recomputes its
        known tokens when it joins again (a pick still in flight is accepted as usual)."""
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.computed = 0
        seq.page_keys = []
        seq.status = SeqStatus.PREEMPTED
        seq.pick_launch = -1
        self.waiting.appendleft(seq)
        self.preemptions += 1
