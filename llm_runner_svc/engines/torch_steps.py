"""The torch engine's steps: `launch` / `read` over the buffers `TorchEngine.preallocate`
claims (torch_engine.py).

A batch of one-token rows runs as a decode step (its CUDA graph on CUDA; rows on LoRA
adapters replay the graph that adds each row's adapter, torch_lora.py). In a batch with
longer rows its leading one-token rows (the scheduler puts the decodes first) still run as a
decode step and the rest as prefill passes (a captured graph per token bucket for short
passes, eager otherwise); each prefill row's last residual goes to its batch row of `x_last`
and one head gives their logits. A step's one host synchronisation is the copy of its picks,
made in `read` after the next step is launched (torch_picks.py).

A verify row (speculative decoding: the last accepted token and K proposed ones) runs as K + 1
decode rows of its sequence, at positions p .. p + K on its page table, when the step holds
no prefill chunk (`_as_decode_rows`; a row of up to the plan's K + 1 tokens, a draft's
catch-up row say, runs so too): the whole step is one decode step (on CUDA the
captured verify variant of the smallest bucket that holds its rows, torch_graphs.py), whose
decode attention lets row j see positions up to p + j, and whose head and argmax give the
logits and greedy pick after every position. Its rows are laid out so that rows 0 .. n-1 are
the batch rows' last positions (their logits and picks where every step leaves them) and the
longer rows' other positions follow. Otherwise (a prefill chunk in the step, LoRA rows on
CUDA, more rows than the largest bucket) verify rows run with the prefill rows, from a
captured prefill graph for a short pass on CUDA, and right after its pass the head turns the
residuals of its K positions before the last into logits. Either way greedy rows take their
argmax on the device (copied out in `read`), sampled ones are picked on the host by the
rejection rule (numpy_sampling.py `verify_picks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm_runner_svc.engines.base import (
    DecodeRow,
    Engine,
    EnginePlan,
    HiddenStates,
    SampleSpec,
    check_batch,
    check_features,
    check_reserve,
)
from llm_runner_svc.engines.batch import (
    MAX_VERIFY,
    Batch,
    Pass,
    Row,
    StepOutput,
    TokenLogprob,
    split_passes,
)
from llm_runner_svc.engines.batched import CapturedStates
from llm_runner_svc.engines.numpy_processors import verify_row_picks
from llm_runner_svc.engines.torch_forward import Forward
from llm_runner_svc.engines.torch_graphs import DecodeGraphs, InputStager, PrefillGraphs
from llm_runner_svc.engines.torch_lora import TorchGroups, TorchLora
from llm_runner_svc.engines.torch_picks import Picks, Started
from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillStager
from llm_runner_svc.engines.torch_state import RunState, decode_adapters, decode_views
from llm_runner_svc.errors import FailedPrecondition
from llm_runner_svc.models.lora import LoraAdapter
from llm_runner_svc.models.spec import ModelConfig

_PLACEHOLDER = SampleSpec(0.0, 0, 1.0)  # the pick of a row without a spec (not returned)


@dataclass(frozen=True)
class Launched:
    """A launched step: its picks on their way to the host, which rows asked for one, and
    the states captured at launch."""

    picks: Started
    sampled: tuple[bool, ...]
    hidden: list[HiddenStates | None]
    verified: list[list[int] | None]  # per row: picks of its verify positions, when known
    on_device: tuple[tuple[int, int, int], ...] = ()  # (row, offset, K): greedy picks at
    #                                                   `verify_ids.view(-1)[offset:]`


def _token(row: Row, i: int) -> int:
    """Token i of `row`; -1-j for the pick of row j of the previous forward."""
    return -1 - row.from_pick if row.from_pick is not None else row.tokens[i]


def _tokens(row: Row) -> list[int]:
    """Every token of `row`, as `_token` gives them."""
    if row.from_pick is not None:
        return [-1 - row.from_pick] * row.length
    return list(row.tokens)



class TorchSteps(Engine):
    """Set up by `TorchEngine.preallocate`."""

    supports_embeds = True  # prefill rows with image embeddings run eagerly (`_prefill`)

    mixed_steps: str
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    lora: TorchLora | None
    state: RunState
    forward: Forward
    stager: InputStager
    prefill_stager: PrefillStager
    graphs: DecodeGraphs | None
    prefill_graphs: PrefillGraphs | None
    picks: Picks
    _plan: EnginePlan | None
    _last_sampled: tuple[bool, ...]
    supports_verify = True
    supports_penalties = True
    supports_masks = True
    supports_logprobs = True
    supports_scores = True

    # ---- LoRA adapter slots (torch_lora.py) --------------------------------------------
    @property
    def max_lora_rank(self) -> int | None:  # type: ignore[override]
        return self.lora.rank if self.lora is not None else None

    def reserve_adapters(self, num_slots: int, max_rank: int | None = None,
                         kernel: str = "auto") -> None:
        """Also `kernel`: how decode rows on adapters run: "triton" (the CUDA default: each
        row's adapter read by Triton kernels inside the decode CUDA graphs, per row in a
        batch of a few rows, grouped by adapter in larger ones), "gather" (the
        same per-row path with torch products), or "grouped" (the CPU default: per adapter
        present, eagerly). The slots are stacked buffers in the engine's dtype on CUDA,
        float32 on the CPU; the adapters held so far move into them."""
        check_reserve(self, num_slots, self._plan is not None)
        held = self.lora.adapters[1:] if self.lora is not None else []
        dtype = self.dtype if self.device.type == "cuda" else torch.float32
        self.lora = None  # its buffers go before the new ones are claimed
        self.lora = TorchLora(self.config, held, self.device, num_slots, max_rank, dtype,
                              kernel)
        self.num_adapters = num_slots

    def set_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        self.check_adapter(slot, adapter)
        assert self.lora is not None
        self.lora.set(slot, adapter)

    def _need_plan(self) -> EnginePlan:
        if self._plan is None:
            raise FailedPrecondition("engine used before preallocate()")
        return self._plan

    def launch(self, batch: Batch) -> Launched:
        """A batch of one-token rows runs as a decode step (its captured graph on CUDA).
        In a batch with longer rows, its leading one-token rows (the scheduler puts the
        decodes first) still run as a decode step and the rest as prefill forwards, so a
        decode row's numbers never depend on what else shares its step; with
        `mixed_steps="joined"` every row runs in the prefill forward instead (the weights
        read once per step, the decode rows on the prefill's products). Nothing here waits
        on the device unless a row captures hidden states."""
        plan = self._need_plan()
        check_batch(self.config, plan, batch, self.num_adapters, self.supports_embeds)
        check_features(self, batch)
        self.picks.scores.begin()
        rows = batch.rows
        n = len(rows)
        feeds = any(r.from_pick is not None for r in rows)
        if feeds:
            last = self._last_sampled
            for r in rows:
                j = r.from_pick
                if j is not None and not (0 <= j < len(last) and last[j]):
                    raise FailedPrecondition(f"a row feeds the pick of row {j} of the "
                                             "previous forward, which made none")
        # leading decodes (a row with prompt scores runs in a prefill pass: `_score_heads`)
        d = next((i for i, r in enumerate(rows) if r.length > 1 or r.score), n)
        if d < n and self.mixed_steps == "joined":
            d = 0
        hidden: list[HiddenStates | None] = [None] * n
        self._verified: list[list[int] | None] = [None] * n
        self._on_device: list[tuple[int, int, int]] = []
        self._headed: set[int] = set()  # batch rows whose logits a verify head wrote
        verify_bucket = self._as_decode_rows(rows, plan) if d < n else None
        if verify_bucket is not None:
            self._decode_rows(rows, verify_bucket, feeds)
            d = n
        else:
            decodes = [DecodeRow(_token(r, 0), r.start, r.pages, r.capture_hidden, r.adapter)
                       for r in rows[:d]]
            bucket = self.graphs.bucket_for(d) if self.graphs is not None else d
            if d:
                self._stage_decode(decodes, bucket, feeds)
            if d < n:  # before the decode: its picks overwrite those this part may feed on
                hidden[d:] = self._prefill(rows[d:], d, feeds)
            if d:
                hidden[:d] = self._decode(decodes, bucket)
        if d < n and not self._headed.issuperset(range(d, n)):  # (verify rows: headed)
            self.forward.head(self.state.x_last[d:n], self.forward.fuses(n - d, False), d)
        specs = [r.sample or _PLACEHOLDER for r in rows]
        self._last_sampled = tuple(r.sample is not None for r in rows)
        return Launched(self.picks.start(specs, has_argmax=d == n), self._last_sampled,
                        hidden, self._verified, tuple(self._on_device))

    def read(self, handle: Launched) -> StepOutput:
        picked = self.picks.wait(handle.picks)
        picks = picked.picks
        verified = list(handle.verified)
        if handle.on_device:  # the speculative step's read is waited for anyway
            hi = max(off + k for _, off, k in handle.on_device)
            ids = self.picks.verify_ids.view(-1)[:hi].cpu().tolist()
            for i, off, k in handle.on_device:
                verified[i] = ids[off:off + k]
        scores: list[list[TokenLogprob] | None] = [picked.scores.get(i)
                                                   for i in range(len(picks))]
        return StepOutput([p if wanted else None
                           for p, wanted in zip(picks, handle.sampled, strict=True)],
                          handle.hidden, verified, picked.logprobs, scores)

    def _stage_decode(self, rows: Sequence[DecodeRow], bucket: int, feeds: bool) -> None:
        """Stage one-token rows for a decode step of `bucket` rows."""
        self.stager.stage(rows, bucket)
        if feeds:
            self.picks.feed(self.state.inputs[:len(rows)])

    def _decode(self, rows: Sequence[DecodeRow], bucket: int) -> list[HiddenStates | None]:
        """The staged decode step: logits rows and greedy picks 0 .. len(rows)-1."""
        plan, s = self._need_plan(), self.state
        b = len(rows)
        capture = plan.hidden_layer is not None and any(r.capture_hidden for r in rows)
        self._run_decode(bucket, [r.adapter for r in rows], capture)
        if not capture:
            return [None] * b
        emb, states = _host_copy(s.cap_emb[:b]), _host_copy(s.cap_state[:b])
        return [HiddenStates(emb[i:i + 1], states[i:i + 1], r.position)
                if r.capture_hidden else None for i, r in enumerate(rows)]

    def _run_decode(self, bucket: int, adapters: Sequence[int], capture: bool,
                    stores_first: bool = False) -> None:
        """The staged decode step of rows with `adapters` (`stores_first`: see
        `Forward.decode`)."""
        s, b = self.state, len(adapters)
        has_lora = any(adapters)
        per_row = has_lora and self.forward.lora is not None and self.forward.lora.is_per_row
        if self.graphs is not None and (per_row or not has_lora):
            self.graphs.replay(bucket, with_lora=per_row, stores_first=stores_first)
            return
        ids, positions, tables = decode_views(s, b)  # on the CPU, or adapters run grouped:
        if per_row:  #                                 eagerly
            self.forward.decode(b, ids, positions, tables, capture,
                                lora_slots=decode_adapters(s, b), stores_first=stores_first)
        else:
            self.forward.decode(b, ids, positions, tables, capture,
                                self._lora_groups(adapters, [1] * b),
                                stores_first=stores_first)

    def _as_decode_rows(self, rows: Sequence[Row], plan: EnginePlan) -> int | None:
        """The bucket in which a step of verify rows, rows of up to the plan's K + 1 tokens
        (`EnginePlan.verify_tokens`) and one-token rows runs as one decode step, a decode
        row per position; None when it runs with prefill passes instead: a longer row (a
        prompt chunk), a row capturing hidden states or reading input embeddings, a row
        with prompt scores, adapter rows where the verify variants hold no LoRA products
        (CUDA), more rows than the largest verify bucket (CUDA) or than the decode buffers
        (`max_decode_rows`)."""
        total = 0
        for r in rows:
            if r.length > 1 and (r.length > 1 + max(r.verify, plan.verify_tokens)
                                 or r.capture_hidden or any(e.end > r.start for e in r.embeds)):
                return None
            if r.score:
                return None
            if self.graphs is not None and r.adapter:
                return None
            total += r.length
        if self.graphs is not None:
            return self.graphs.verify_bucket_for(total)
        return total if total <= plan.max_decode_rows else None

    def _decode_rows(self, rows: Sequence[Row], bucket: int, feeds: bool) -> None:
        """Every position of the step as a decode row, in one decode step of `bucket` rows:
        first each row's last position (so logits and picks rows 0 .. n-1 are the batch
        rows'), then the positions before it of each longer row, in row order (a verify
        row's K verified positions are its last K of those). Greedy verify picks are copied
        to `verify_ids` before a later step can overwrite `next_ids`."""
        n = len(rows)
        ids = [_token(r, r.length - 1) for r in rows]
        positions = [r.end - 1 for r in rows]
        tables = [r.pages for r in rows]
        adapters = [r.adapter for r in rows]
        for r in rows:
            if r.length > 1:
                m = r.length - 1
                ids += r.tokens[:m]
                positions += range(r.start, r.start + m)
                tables += [r.pages] * m
                adapters += [r.adapter] * m
        self.stager.stage_columns(ids, positions, adapters, tables, bucket)
        if feeds:
            self.picks.feed(self.state.inputs[:len(ids)])
        self._run_decode(bucket, adapters, capture=False, stores_first=True)
        s, end = self.state, 0  # end: of the row's other positions, after row n-1
        for i, r in enumerate(rows):
            end += r.length - 1
            k = r.verify
            if k and r.sample is not None:
                if r.sample.is_greedy and not r.verify_samples:
                    self._on_device.append((i, end - k, k))
                else:  # sampled, or under a constraint's masks: on the host
                    self._verified[i] = verify_row_picks(
                        _host_copy(s.logits[n + end - k:n + end]), r.verify_samples,
                        r.tokens[-k:])
        if self._on_device:
            self.picks.verify_ids.view(-1)[:end].copy_(s.next_ids[n:n + end])

    def _prefill(self, rows: Sequence[Row], first: int, feeds: bool
                 ) -> list[HiddenStates | None]:
        """`rows` (batch rows first ..) in forwards of up to a pass's tokens each (one,
        unless they hold more than the runtime's step budget); each row's last residual
        goes to its batch row of `x_last`, for the head."""
        plan, s, stager = self._need_plan(), self.state, self.prefill_stager
        tokens = [_tokens(r) for r in rows]
        capture = plan.hidden_layer is not None and any(r.capture_hidden for r in rows)
        caps = CapturedStates(rows)
        for p in split_passes(Batch(rows), tokens, stager.max_tokens, stager.max_tokens):
            chunks = [PrefillChunk(seg.tokens, seg.start, seg.pages,
                                   first + seg.row if seg.is_last else plan.max_batch)
                      for seg in p.segments]
            stager.check(chunks, plan.max_seq)
            lora = self._lora_groups([rows[seg.row].adapter for seg in p.segments],
                                     [len(seg.tokens) for seg in p.segments])
            overrides = [(seg.offset + k, values) for seg in p.segments
                         for k, values in seg.overrides()]
            # rows on LoRA adapters or with image embeddings run eagerly: the graphs hold none
            graphs = None if lora or overrides else self.prefill_graphs
            bucket = graphs.bucket_for(p.num_tokens) if graphs is not None else None
            if graphs is not None and bucket is not None:
                layout = graphs.stage(chunks, bucket)
            else:
                layout = stager.stage(chunks, self.forward.ops.prefill_block(p.num_tokens))
            if feeds and any(rows[seg.row].from_pick is not None for seg in p.segments):
                self.picks.feed(layout.ids)
            if graphs is not None and bucket is not None:
                graphs.replay(bucket)
            else:
                self.forward.prefill(layout, capture and p.capture, lora, overrides)
            self._verify_heads(p, rows, first)
            self._score_heads(p, rows, first)
            if capture and p.capture:
                caps.add(p, _host_copy(s.cap_emb[:p.num_tokens]),
                         _host_copy(s.cap_state[:p.num_tokens]))
        return caps.joined() if capture else [None] * len(rows)

    def _verify_heads(self, p: Pass, rows: Sequence[Row], first: int) -> None:
        """The picks of the verify rows that pass `p` ran (batch rows first ..), from the
        residuals of their last K + 1 positions, before the next pass overwrites them (a
        verify row is never cut across passes): one head product over the K + 1 (the head
        is read once), the last one's logits into the row's logits row as every row's."""
        for seg in p.segments:
            row = rows[seg.row]
            if not (row.verify and seg.is_last and row.sample is not None):
                continue
            k = row.verify
            lo = seg.offset + len(seg.tokens) - 1 - k
            every = self.picks.verify_logits[:k + 1]
            self.forward.head(self.state.x[lo:lo + k + 1], self.forward.fuses(k + 1, False),
                              out=every)
            self.state.logits[first + seg.row].copy_(every[k])
            self._headed.add(first + seg.row)
            logits = every[:k]
            if row.sample.is_greedy and not row.verify_samples:
                torch.argmax(logits, dim=-1, out=self.picks.verify_ids[first + seg.row, :k])
                self._on_device.append((first + seg.row, (first + seg.row) * MAX_VERIFY, k))
            else:  # sampled, or under a constraint's masks: on the host
                self._verified[first + seg.row] = verify_row_picks(
                    _host_copy(logits), row.verify_samples, row.tokens[1:])

    def _score_heads(self, p: Pass, rows: Sequence[Row], first: int) -> None:
        """The prompt scores of the rows' positions that pass `p` ran (batch rows first ..),
        from their residuals, before the next pass overwrites them."""
        for seg in p.segments:
            row = rows[seg.row]
            lo = seg.start - row.start
            hi = min(len(row.score), lo + len(seg.tokens))
            if lo < hi:
                self.picks.scores.add(self._head, self.state.x[seg.offset:seg.offset + hi - lo],
                                      row.score[lo:hi], row.score_top, first + seg.row)

    def _head(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [m, vocab] float32 = the logits of residual rows x [m, hidden]."""
        self.forward.head(x, self.forward.fuses(x.shape[0], False), out=out)

    def _lora_groups(self, adapters: Sequence[int], lengths: Sequence[int]) -> TorchGroups:
        """A forward's rows by LoRA adapter: `adapters` (one per stretch of `lengths`)."""
        lora = self.forward.lora
        return lora.groups(adapters, lengths) if lora is not None else []

    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        self._need_plan()
        return self.picks.wait(self.picks.start(specs, has_argmax=False)).picks

    def logits(self, num_rows: int) -> np.ndarray:
        self._need_plan()
        return _host_copy(self.state.logits[:num_rows])

    def top_probabilities(self, num_rows: int) -> list[float]:
        self._need_plan()
        top: list[float] = torch.softmax(self.state.logits[:num_rows], dim=-1).amax(-1).tolist()
        return top


def _host_copy(t: torch.Tensor) -> np.ndarray:
    """A host array that owns its data (a CPU tensor's numpy view would alias a buffer).
    On the CPU numpy makes the copy, so captured states handed to the runtime (which may
    hold a step's until it reads the next) never sit in torch's allocator."""
    if t.device.type == "cpu":
        return np.array(t.numpy(), copy=True)
    out: np.ndarray = t.to("cpu", copy=True).numpy()
    return out

