"""The torch engine: the numpy engine's decoder on a torch device.

On the CPU it computes in float32 with plain torch operations (the same numbers as the numpy
reference). On CUDA it holds bf16 weights and KV (float32 residual stream, logits and
sampling), runs the elementwise and attention steps as fused Triton kernels, and replays each
decode step as a CUDA graph captured per batch-size bucket in `preallocate()`. At batch 1
(`fused_rows`) and in prefill batches of up to `fused_prefill_rows` tokens the products take
float32 activations with the norms and epilogues fused around them
(torch_triton_products.py); longer prefill batches multiply on cuBLAS in bf16 at the tensor
cores' full rate, and attend with one FlashAttention-style launch over the paged pool
(torch_triton_prefill.py). Decode attention reads only the filled pages of each row.

A step (`launch`) is a decode when every row is one token, else one prefill forward over all
rows (see `launch`). A step's one host synchronisation is the copy of its picks, made in
`read` after the next step is launched; a row that feeds the previous step's pick takes it
on the device (torch_picks.py). Hidden states stay staged on the device unless a row asked
for them.
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
    check_hidden_layer,
    is_same_plan,
)
from llm_runner_svc.engines.batch import Batch, Row, StepOutput, split_passes
from llm_runner_svc.engines.batched import CapturedStates
from llm_runner_svc.engines.torch_forward import Forward, has_float32_products
from llm_runner_svc.engines.torch_graphs import (
    DecodeGraphs,
    InputStager,
    PrefillGraphs,
    prefill_buckets,
)
from llm_runner_svc.engines.torch_ops import TorchOps
from llm_runner_svc.engines.torch_picks import Picks, Started
from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillStager
from llm_runner_svc.engines.torch_state import allocate_state, decode_views, pass_tokens
from llm_runner_svc.engines.torch_weights import TorchWeights, load_weights
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
FUSED_ROWS = 1  # batch 1; the fused kernel's few-row variants lose to cuBLAS
# Prefill batches up to this many tokens keep float32 activations (the parity tests' windows
# among them); past it cuBLAS's bf16 products are what makes a long prompt fast.
FUSED_PREFILL_ROWS = 64
# Prefill passes up to this many tokens run from CUDA graphs: below it an eager forward's
# launches take longer on the host than its work on the GPU (7B shapes, H200).
PREFILL_GRAPH_TOKENS = 512
_PLACEHOLDER = SampleSpec(0.0, 0, 1.0)  # the pick of a row without a spec (not returned)


@dataclass(frozen=True)
class Launched:
    """A launched step: its picks on their way to the host, which rows asked for one, and
    the states captured at launch."""

    picks: Started
    sampled: tuple[bool, ...]
    hidden: list[HiddenStates | None]


def _token(row: Row, i: int) -> int:
    """Token i of `row`; -1-j for the pick of row j of the previous forward."""
    return -1 - row.from_pick if row.from_pick is not None else row.tokens[i]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None or "auto": the first GPU when there is one, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise InvalidArgument(f"device {device!r} is not a torch device ({exc})") from exc
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device {device!r}: the torch engine runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device!r}: this torch build or machine has no CUDA")
    return dev


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, config: ModelConfig, weights: ModelWeights | TorchWeights,
                 device: str | torch.device | None = None, dtype: str | None = None,
                 kernels: str = "auto", fused_rows: int = FUSED_ROWS,
                 fused_prefill_rows: int = FUSED_PREFILL_ROWS,
                 mixed_steps: str = "split",
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS) -> None:
        """`dtype`: "float32" or "bfloat16" (default: bf16 on CUDA, float32 on the CPU).
        `kernels`: "triton" (the CUDA default: fused kernels, decode steps as CUDA graphs), or
        "torch" for the plain reference ops, run eagerly.
        `fused_rows`: with triton kernels and bf16 weights, decode batches of at most this
        many rows (and every prefill window) run on the fused products of
        torch_triton_products.py, but for matrices past its GEMV_LIMITS; larger batches on
        cuBLAS. 0 turns the fused products off.
        `fused_prefill_rows`: prefill batches of at most this many tokens do too (every
        product); longer ones multiply on cuBLAS with bf16 activations.
        `mixed_steps`: how a step with decode rows and prompt chunks runs: "split" (the
        decodes as a decode step, the chunks as a prefill forward) or "joined" (one prefill
        forward over all rows); see `launch`.
        `prefill_graph_tokens`: with triton kernels on CUDA, prefill passes of up to this
        many tokens replay a CUDA graph captured per power-of-two bucket (0: always eager)."""
        self.config = config
        self.device = resolve_device(device)
        default = "bfloat16" if self.device.type == "cuda" else "float32"
        if (dtype or default) not in _DTYPES:
            raise InvalidArgument(f"dtype {dtype!r}: one of {sorted(_DTYPES)}")
        self.dtype = _DTYPES[dtype or default]
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" else "torch"
        if kernels not in ("triton", "torch"):
            raise InvalidArgument(f"kernels {kernels!r}: 'triton' or 'torch'")
        self.kernels = kernels
        if fused_rows < 0 or fused_prefill_rows < 0:
            raise InvalidArgument(f"fused_rows {fused_rows}, fused_prefill_rows "
                                  f"{fused_prefill_rows}: must be 0 or more")
        if mixed_steps not in ("split", "joined"):
            raise InvalidArgument(f"mixed_steps {mixed_steps!r}: 'split' or 'joined'")
        self.mixed_steps = mixed_steps
        self.prefill_graph_tokens = max(0, prefill_graph_tokens)
        self.fused_rows = fused_rows
        self.fused_prefill_rows = fused_prefill_rows
        self.weights = weights if isinstance(weights, TorchWeights) else load_weights(
            weights, config, self.device, self.dtype)
        self._plan: EnginePlan | None = None
        self._bytes = 0

    # ---- lifecycle -------------------------------------------------------------------
    def preallocate(self, plan: EnginePlan) -> None:
        if is_same_plan(self._plan, plan):
            return
        c = self.config
        check_hidden_layer(c, plan)
        if self.device.type == "cpu":
            # A decode step multiplies a few rows by each matrix: on one thread that takes
            # microseconds, while waking a second one costs more than it saves (tens of
            # times more where the cores are shared).
            torch.set_num_threads(1)
        has_f32 = has_float32_products(self.device, self.dtype)
        has_fused = (self.kernels == "triton" and self.dtype == torch.bfloat16
                     and self.fused_rows > 0)
        self.state = allocate_state(
            c, plan, plan.max_batch, self.device, self.dtype, has_wide_scratch=not has_f32,
            fused_rows=max(self.fused_rows, self.fused_prefill_rows) if has_fused else 0)
        self.prefill_stager = PrefillStager(
            max_tokens=pass_tokens(plan), max_chunks=plan.max_batch,
            pages=self.state.pages_per_seq, page_size=plan.page_size,
            scratch_page=plan.num_pages, device=self.device)
        self._bytes = self.state.nbytes + self.prefill_stager.nbytes
        ops = TorchOps(c, plan.page_size)
        if self.kernels == "triton":
            from llm_runner_svc.engines.torch_triton import TritonOps

            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 1)
            ops = TritonOps(c, plan.page_size, num_sms, has_fused)
            self._bytes += ops.reserve(plan.max_batch, plan.max_seq, self.device)
        self.forward = Forward(c, self.weights, ops, self.state, plan.hidden_layer,
                               plan.page_size, has_f32, self.fused_rows,
                               self.fused_prefill_rows)
        self.stager = InputStager(self.state, scratch_page=plan.num_pages)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self._plan = plan
        if self.device.type == "cuda" and self.kernels == "triton":
            with torch.cuda.device(self.device):
                self.graphs = DecodeGraphs(self.forward, self.state, plan.max_batch,
                                           capture_hidden=plan.hidden_layer is not None)
                self.graphs.capture()
                buckets = prefill_buckets(self.prefill_stager.max_tokens,
                                          self.prefill_graph_tokens)
                if buckets:
                    self.prefill_graphs = PrefillGraphs(
                        self.forward, self.prefill_stager, buckets,
                        capture_hidden=plan.hidden_layer is not None, pad_dest=plan.max_batch)
                    self.prefill_graphs.capture()
        self.picks = Picks(self.state.logits, self.state.next_ids, pass_tokens(plan))
        self._bytes += self.picks.nbytes
        self._last_sampled: tuple[bool, ...] = ()  # which rows of the last forward picked

    def close(self) -> None:
        if self._plan is None:
            return
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.close()
        for name in ("graphs", "prefill_graphs", "stager", "prefill_stager", "forward", "picks",
                     "state"):
            delattr(self, name)
        self._plan = None
        self._bytes = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_bytes(self) -> int:
        return self._bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.config.num_layers * self.config.kv_dim * self.dtype.itemsize

    def free_device_bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def _need_plan(self) -> EnginePlan:
        if self._plan is None:
            raise FailedPrecondition("engine used before preallocate()")
        return self._plan

    # ---- steps -----------------------------------------------------------------------
    def launch(self, batch: Batch) -> Launched:
        """A batch of one-token rows runs as a decode step (its captured graph on CUDA).
        In a batch with longer rows, its leading one-token rows (the scheduler puts the
        decodes first) still run as a decode step and the rest as prefill forwards, so a
        decode row's numbers never depend on what else shares its step; with
        `mixed_steps="joined"` every row runs in the prefill forward instead (the weights
        read once per step, the decode rows on the prefill's products). Nothing here waits
        on the device unless a row captures hidden states."""
        plan = self._need_plan()
        check_batch(self.config, plan, batch)
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
        d = next((i for i, r in enumerate(rows) if r.length > 1), n)  # leading decodes
        if d < n and self.mixed_steps == "joined":
            d = 0
        decodes = rows[:d]
        hidden: list[HiddenStates | None] = [None] * n
        bucket = self._stage_decode(decodes, feeds) if d else 0
        if d < n:  # before the decode: its picks overwrite those this part may feed on
            hidden[d:] = self._prefill(rows[d:], d, feeds)
        if d:
            hidden[:d] = self._decode(decodes, bucket)
        if d < n:
            self.forward.head(self.state.x_last[d:n], self.forward.fuses(n - d, False), d)
        specs = [r.sample or _PLACEHOLDER for r in rows]
        self._last_sampled = tuple(r.sample is not None for r in rows)
        return Launched(self.picks.start(specs, has_argmax=d == n), self._last_sampled,
                        hidden)

    def read(self, handle: Launched) -> StepOutput:
        picks = self.picks.wait(handle.picks)
        return StepOutput([p if wanted else None
                           for p, wanted in zip(picks, handle.sampled, strict=True)],
                          handle.hidden)

    def _stage_decode(self, rows: Sequence[Row], feeds: bool) -> int:
        """Stage one-token rows for the decode step; returns its bucket."""
        b = len(rows)
        bucket = self.graphs.bucket_for(b) if self.graphs is not None else b
        self.stager.stage([DecodeRow(_token(r, 0), r.start, r.pages) for r in rows], bucket)
        if feeds:
            self.picks.feed(self.state.inputs[:b])
        return bucket

    def _decode(self, rows: Sequence[Row], bucket: int) -> list[HiddenStates | None]:
        """The staged decode step: logits rows and greedy picks 0 .. len(rows)-1."""
        plan, s = self._need_plan(), self.state
        b = len(rows)
        capture = plan.hidden_layer is not None and any(r.capture_hidden for r in rows)
        if self.graphs is not None:
            self.graphs.replay(bucket)
        else:
            ids, positions, tables = decode_views(s, b)
            self.forward.decode(b, ids, positions, tables, capture)
        if not capture:
            return [None] * b
        emb, states = _host_copy(s.cap_emb[:b]), _host_copy(s.cap_state[:b])
        return [HiddenStates(emb[i:i + 1], states[i:i + 1], r.start)
                if r.capture_hidden else None for i, r in enumerate(rows)]

    def _prefill(self, rows: Sequence[Row], first: int, feeds: bool
                 ) -> list[HiddenStates | None]:
        """`rows` (batch rows first ..) in forwards of up to a pass's tokens each (one,
        unless they hold more than the runtime's step budget); each row's last residual
        goes to its batch row of `x_last`, for the head."""
        plan, s, stager = self._need_plan(), self.state, self.prefill_stager
        tokens = [[_token(r, i) for i in range(r.length)] for r in rows]
        capture = plan.hidden_layer is not None and any(r.capture_hidden for r in rows)
        caps = CapturedStates(rows)
        for p in split_passes(Batch(rows), tokens, stager.max_tokens, stager.max_tokens):
            chunks = [PrefillChunk(seg.tokens, seg.start, seg.pages,
                                   first + seg.row if seg.is_last else plan.max_batch)
                      for seg in p.segments]
            stager.check(chunks, plan.max_seq)
            graphs = self.prefill_graphs
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
                self.forward.prefill(layout, capture and p.capture)
            if capture and p.capture:
                caps.add(p, _host_copy(s.cap_emb[:p.num_tokens]),
                         _host_copy(s.cap_state[:p.num_tokens]))
        return caps.joined() if capture else [None] * len(rows)

    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        self._need_plan()
        return self.picks.wait(self.picks.start(specs, has_argmax=False))

    def logits(self, num_rows: int) -> np.ndarray:
        self._need_plan()
        return _host_copy(self.state.logits[:num_rows])


def _host_copy(t: torch.Tensor) -> np.ndarray:
    """A host array that owns its data (a CPU tensor's numpy view would alias a buffer).
    On the CPU numpy makes the copy, so captured states handed to the runtime (which may
    hold a step's until it reads the next) never sit in torch's allocator."""
    if t.device.type == "cpu":
        return np.array(t.numpy(), copy=True)
    out: np.ndarray = t.to("cpu", copy=True).numpy()
    return out

