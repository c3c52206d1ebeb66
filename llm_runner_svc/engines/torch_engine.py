"""The torch engine: the numpy engine's decoder on a torch device.

On the CPU it computes in float32 with plain torch operations (the same numbers as the numpy
reference). On CUDA it holds bf16 weights and KV (float32 residual stream, logits and
sampling), runs the elementwise and attention steps as fused Triton kernels, and replays each
decode step as a CUDA graph captured per batch-size bucket in `preallocate()`. At batch 1
(`fused_rows`) and in prefill batches of up to `fused_prefill_rows` tokens the products take
float32 activations with the norms and epilogues fused around them
(torch_triton_products.py); longer prefill batches multiply on cuBLAS in bf16 at the tensor
cores' full rate, and attend with one FlashAttention-style launch over the paged pool
(torch_triton_prefill.py). Decode attention reads only the filled pages of each row. A
decode step's one host synchronisation is the copy of its new token ids, and it can be
chained: a decode may take the previous decode's picks where they lie on the device, so the
runtime queues step n+1 before it waits for step n. Hidden states stay staged on the device
unless a row asked for them.

`prefill_batch` runs chunks of several requests (each some new tokens after the positions
already in its pages) in one forward; `prefill` is one request's prompt, chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from llm_runner_svc.engines.base import (
    CHAINED,
    DecodeRow,
    Engine,
    EnginePlan,
    HiddenStates,
    SampleSpec,
    check_hidden_layer,
    check_prefill_fits,
    check_token_ids,
    is_same_plan,
)
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias as host_logit_bias
from llm_runner_svc.engines.numpy_sampling import sample_rows
from llm_runner_svc.engines.torch_forward import Forward, has_float32_products
from llm_runner_svc.engines.torch_graphs import DecodeGraphs, InputStager
from llm_runner_svc.engines.torch_ops import TorchOps
from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillStager
from llm_runner_svc.engines.torch_sampling import apply_logit_bias, sample_on_device
from llm_runner_svc.engines.torch_state import allocate_state, decode_views
from llm_runner_svc.engines.torch_weights import TorchWeights, load_weights
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
FUSED_ROWS = 1  # batch 1; the fused kernel's few-row variants lose to cuBLAS
# Prefill batches up to this many tokens keep float32 activations (the parity tests' windows
# among them); past it cuBLAS's bf16 products are what makes a long prompt fast.
FUSED_PREFILL_ROWS = 64


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
    supports_chaining = True

    def __init__(self, config: ModelConfig, weights: ModelWeights | TorchWeights,
                 device: str | torch.device | None = None, dtype: str | None = None,
                 kernels: str = "auto", fused_rows: int = FUSED_ROWS,
                 fused_prefill_rows: int = FUSED_PREFILL_ROWS) -> None:
        """`dtype`: "float32" or "bfloat16" (default: bf16 on CUDA, float32 on the CPU).
        `kernels`: "triton" (the CUDA default: fused kernels, decode steps as CUDA graphs), or
        "torch" for the plain reference ops, run eagerly.
        `fused_rows`: with triton kernels and bf16 weights, decode batches of at most this
        many rows (and every prefill window) run on the fused products of
        torch_triton_products.py, but for matrices past its GEMV_LIMITS; larger batches on
        cuBLAS. 0 turns the fused products off.
        `fused_prefill_rows`: prefill batches of at most this many tokens do too (every
        product); longer ones multiply on cuBLAS with bf16 activations."""
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
        self.fused_rows = fused_rows
        self.fused_prefill_rows = fused_prefill_rows
        self.weights = weights if isinstance(weights, TorchWeights) else load_weights(
            weights, config, self.device, self.dtype)
        self._plan: EnginePlan | None = None
        self._bytes = 0
        self._greedy_ready = False

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
            max_tokens=max(plan.max_batch, plan.prefill_chunk), max_chunks=plan.max_batch,
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
        self._plan = plan
        if self.device.type == "cuda" and self.kernels == "triton":
            with torch.cuda.device(self.device):
                self.graphs = DecodeGraphs(self.forward, self.state, plan.max_batch,
                                           capture_hidden=plan.hidden_layer is not None)
                self.graphs.capture()
        self._last_batch = 0
        self._turn = 0
        if self.device.type == "cuda":  # two sets: a step's picks land while the last's wait
            self._done = (torch.cuda.Event(), torch.cuda.Event())
            self._ids_host = torch.zeros((2, plan.max_batch), dtype=torch.int64,
                                         pin_memory=True)

    def close(self) -> None:
        if self._plan is None:
            return
        if self.graphs is not None:
            self.graphs.close()
        for name in ("graphs", "stager", "prefill_stager", "forward", "state"):
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

    # ---- forward ---------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int], start_pos: int, page_table: Sequence[int],
                capture_hidden: bool = False) -> HiddenStates | None:
        plan = self._need_plan()
        check_prefill_fits(plan, len(token_ids), start_pos)
        parts = [self.prefill_batch([PrefillChunk(token_ids[lo:lo + plan.prefill_chunk],
                                                  start_pos + lo, page_table)],
                                    capture_hidden)[0]
                 for lo in range(0, len(token_ids), plan.prefill_chunk)]
        if not capture_hidden:
            return None
        caps = [p for p in parts if p is not None]
        return HiddenStates(embeddings=np.concatenate([p.embeddings for p in caps]),
                            states=np.concatenate([p.states for p in caps]),
                            start_position=start_pos)

    def prefill_batch(self, chunks: Sequence[PrefillChunk], capture_hidden: bool = False
                      ) -> list[HiddenStates | None]:
        """One forward over `chunks` (each some new tokens of one request after the
        positions already in its pages; together at most max(maxBatch, prefill_chunk)
        tokens in at most maxBatch chunks): their k and v go into the pool and logits row i
        is chunk i's last token's. Returns, per chunk, its window's states when
        `capture_hidden` (a plan with a hidden layer), else None."""
        plan = self._need_plan()
        num_tokens = self.prefill_stager.check(chunks, plan.max_seq)
        for ch in chunks:
            check_token_ids(self.config, ch.token_ids)
        layout = self.prefill_stager.stage(chunks, self.forward.ops.prefill_block(num_tokens))
        capture = capture_hidden and plan.hidden_layer is not None
        self.forward.prefill(layout, capture)
        self._greedy_ready = False
        self._last_batch = 0  # the picks a chained decode would read are overwritten
        if not capture:
            return [None] * len(chunks)
        s = self.state
        emb, states = _host_copy(s.cap_emb[:num_tokens]), _host_copy(s.cap_state[:num_tokens])
        return [HiddenStates(emb[first:first + n], states[first:first + n], start)
                for first, n, start in layout.spans]

    def decode(self, rows: Sequence[DecodeRow]) -> list[HiddenStates | None]:
        plan = self._need_plan()
        b = len(rows)
        if not 0 < b <= plan.max_batch:
            raise InvalidArgument(f"decode batch of {b} rows; maxBatch is {plan.max_batch}")
        if max(r.position for r in rows) >= plan.max_seq:
            raise InvalidArgument(f"decode position beyond maxSeq {plan.max_seq}")
        is_chained = rows[0].token_id == CHAINED
        if is_chained and (b != self._last_batch
                           or any(r.token_id != CHAINED for r in rows)):
            raise FailedPrecondition("a chained decode takes every row of the previous decode")
        if not is_chained:
            check_token_ids(self.config, [r.token_id for r in rows])
        self._last_batch = b
        capture = plan.hidden_layer is not None and any(r.capture_hidden for r in rows)
        bucket = self.graphs.bucket_for(b) if self.graphs is not None else b
        self.stager.stage(rows, bucket)
        if is_chained:  # the previous picks, still where the last step left them
            self.state.inputs[:b].copy_(self.state.next_ids[:b])
        if self.graphs is not None:
            self.graphs.replay(bucket)
        else:
            ids, positions, tables = decode_views(self.state, b)
            self.forward.decode(b, ids, positions, tables, capture)
        self._greedy_ready = True
        if not capture:
            return [None] * b
        emb, states = _host_copy(self.state.cap_emb[:b]), _host_copy(self.state.cap_state[:b])
        return [HiddenStates(emb[i:i + 1], states[i:i + 1], r.position)
                if r.capture_hidden else None for i, r in enumerate(rows)]

    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        return self.finish_sample(self.start_sample(specs))

    def start_sample(self, specs: Sequence[SampleSpec]) -> Any:
        self._need_plan()
        n = len(specs)
        s = self.state
        if self.device.type == "cpu":
            logits = s.logits[:n].numpy()
            host_logit_bias(logits, specs)
            picks = sample_rows(logits, specs)
            s.next_ids[:n].numpy()[:] = picks  # where a chained decode reads them
            return picks
        is_plain = all(sp.is_greedy and not sp.logit_bias for sp in specs)
        if not (is_plain and self._greedy_ready):
            apply_logit_bias(s.logits[:n], specs)
            sample_on_device(s.logits[:n], specs, s.next_ids[:n])
        turn = self._turn = 1 - self._turn
        self._ids_host[turn, :n].copy_(s.next_ids[:n], non_blocking=True)
        self._done[turn].record()
        return turn, n

    def finish_sample(self, started: Any) -> list[int]:
        if self.device.type == "cpu":
            return super().finish_sample(started)
        turn, n = started
        self._done[turn].synchronize()  # the step's one wait on the device
        picks: list[int] = self._ids_host[turn, :n].tolist()
        return picks

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

