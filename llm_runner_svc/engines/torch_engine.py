"""The torch engine: the numpy engine's decoder on a torch device.

On the CPU it computes in float32 with plain torch operations (the same numbers as the numpy
reference). On CUDA it holds bf16 weights and KV (float32 residual stream, logits and
sampling), runs the elementwise and attention steps as fused Triton kernels, and replays each
decode step as a CUDA graph captured per batch-size bucket in `preallocate()`. At batch 1
(`fused_rows`) and in prefill batches of up to `fused_prefill_rows` tokens the products take
float32 activations with the norms and epilogues fused around them
(torch_triton_products.py); longer prefill batches multiply on cuBLAS in bf16 at the tensor
cores' full rate, and attend with one FlashAttention-style launch over the paged pool
(torch_triton_prefill.py). Short prefill passes (up to `short_prefill_rows` tokens, a
reusing request's new turn) run the products a measured tiling says are faster on the short
products (torch_triton_short.py) and the rest on cuBLASLt. Decode attention reads only the
filled pages of each row.
Prefill passes of up to `prefill_graph_tokens` replay graphs too, one per token bucket.

This module builds the engine and claims its buffers; its steps (`launch` / `read`) are in
torch_steps.py. Hidden states stay staged on the device unless a row asked for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from llm_runner_svc.engines.base import EnginePlan, check_hidden_layer, is_same_plan
from llm_runner_svc.engines.torch_forward import Forward, has_float32_products
from llm_runner_svc.engines.torch_graphs import (
    DecodeGraphs,
    InputStager,
    PrefillGraphs,
    prefill_buckets,
)
from llm_runner_svc.engines.torch_lora import TorchLora
from llm_runner_svc.engines.torch_ops import TorchOps
from llm_runner_svc.engines.torch_picks import Picks
from llm_runner_svc.engines.torch_prefill import PrefillStager
from llm_runner_svc.engines.torch_state import allocate_state, pass_tokens
from llm_runner_svc.engines.torch_steps import TorchSteps
from llm_runner_svc.engines.torch_triton_modes import SHORT_TILINGS, Shape, Tiling
from llm_runner_svc.engines.torch_weights import TorchWeights, load_weights
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.lora import LoraAdapter
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

if TYPE_CHECKING:  # (CUDA only)
    from llm_runner_svc.engines.torch_triton_short import ShortProducts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
FUSED_ROWS = 1  # batch 1; the fused kernel's few-row variants lose to cuBLAS
# Prefill batches up to this many tokens keep float32 activations (the parity tests' windows
# among them) on models of up to FUSED_PREFILL_PARAMS parameters; past it cuBLAS's bf16
# products are what makes a long prompt fast. The fused products cost more than cuBLAS's
# where the weights are big (7B shape, H200: a 50-token prefill after a 2,000-token cached
# prefix takes 20.8 ms on them, 7.5 ms on cuBLAS), so larger models skip them by default.
FUSED_PREFILL_ROWS = 64
FUSED_PREFILL_PARAMS = 1_000_000_000
# Prefill passes of up to this many tokens on bf16 weights (and no float32 activations)
# may multiply on the short products (torch_triton_short.py), each product that holds a
# measured tiling; 0: every product on cuBLAS.
SHORT_PREFILL_ROWS = 64
# Prefill passes up to this many tokens run from CUDA graphs: below it an eager forward's
# launches take longer on the host than its work on the GPU (7B shapes, H200).
PREFILL_GRAPH_TOKENS = 512
# Prompt scores: positions one head product turns into logits (at most the decode rows, which
# the head's scratch holds).
SCORE_CHUNK = 32


def default_fused_prefill_rows(config: ModelConfig) -> int:
    """FUSED_PREFILL_ROWS for a model of up to FUSED_PREFILL_PARAMS parameters, else 0."""
    c = config
    per_layer = c.hidden_size * (c.q_dim + 2 * c.kv_dim + c.q_dim + 3 * c.intermediate_size)
    params = c.num_layers * per_layer + 2 * c.vocab_size * c.hidden_size
    return FUSED_PREFILL_ROWS if params <= FUSED_PREFILL_PARAMS else 0


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


class TorchEngine(TorchSteps):
    name = "torch"

    def __init__(self, config: ModelConfig, weights: ModelWeights | TorchWeights,
                 device: str | torch.device | None = None, dtype: str | None = None,
                 kernels: str = "auto", fused_rows: int = FUSED_ROWS,
                 fused_prefill_rows: int | None = None,
                 mixed_steps: str = "split",
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
                 split_prefill_keys: bool = True,
                 adapters: Sequence[LoraAdapter] = (),
                 short_prefill_rows: int = SHORT_PREFILL_ROWS,
                 short_tilings: Mapping[Shape, Tiling] | None = None,
                 device_sampling: bool = False) -> None:
        """`dtype`: "float32" or "bfloat16" (default: bf16 on CUDA, float32 on the CPU).
        `kernels`: "triton" (the CUDA default: fused kernels, decode steps as CUDA graphs), or
        "torch" for the plain reference ops, run eagerly.
        `fused_rows`: with triton kernels and bf16 weights, decode batches of at most this
        many rows (and every prefill window) run on the fused products of
        torch_triton_products.py, but for matrices past its GEMV_LIMITS; larger batches on
        cuBLAS. 0 turns the fused products off.
        `fused_prefill_rows`: prefill batches of at most this many tokens do too (every
        product); longer ones multiply on cuBLAS with bf16 activations. None: 64 for a
        model of up to a billion parameters, else 0 (`default_fused_prefill_rows`).
        `mixed_steps`: how a step with decode rows and prompt chunks runs: "split" (the
        decodes as a decode step, the chunks as a prefill forward) or "joined" (one prefill
        forward over all rows); see `launch`.
        `prefill_graph_tokens`: with triton kernels on CUDA, prefill passes of up to this
        many tokens replay a CUDA graph captured per power-of-two bucket (0: always eager).
        `split_prefill_keys`: with triton kernels, short prefill passes (after a long cached
        prefix, say) spread each query block's keys over several programs and combine them
        (torch_triton_prefill.py); False: one program per block and head.
        `adapters`: the LoRA adapters a row may name (row adapter k: `adapters[k - 1]`);
        on CUDA, decode batches with such rows replay their own graphs, which add each
        row's adapter from stacked slot buffers (torch_lora_triton.py; at batch 1 inside
        the fused products, in larger batches reading each adapter once); a prefill forward
        with such rows runs eagerly and unfused (torch_lora.py).
        `short_prefill_rows`: with triton kernels and bf16 weights, prefill passes of more
        than `fused_prefill_rows` and at most this many tokens (up to 64) multiply on the
        short products (torch_triton_short.py) those products that `short_tilings` holds a
        tiling for ((output columns, k, mode, norm inside) -> Tiling, as
        `bench_short_products.py --write` measures them; None: the measured
        `SHORT_TILINGS`), the rest on cuBLASLt; 0: every product on the default cuBLAS.
        `device_sampling`: on the CPU, process logits and pick with the torch code CUDA runs
        (torch_picks.py) rather than on the host with numpy (a test of that code; CUDA
        always picks on the device)."""
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
        if fused_prefill_rows is None:
            fused_prefill_rows = default_fused_prefill_rows(config)
        if fused_rows < 0 or fused_prefill_rows < 0:
            raise InvalidArgument(f"fused_rows {fused_rows}, fused_prefill_rows "
                                  f"{fused_prefill_rows}: must be 0 or more")
        if mixed_steps not in ("split", "joined"):
            raise InvalidArgument(f"mixed_steps {mixed_steps!r}: 'split' or 'joined'")
        self.mixed_steps = mixed_steps
        self.prefill_graph_tokens = max(0, prefill_graph_tokens)
        self.split_prefill_keys = split_prefill_keys
        if not 0 <= short_prefill_rows <= 64:
            raise InvalidArgument(f"short_prefill_rows {short_prefill_rows}: 0 to 64")
        self.short_prefill_rows = short_prefill_rows
        self.short_tilings = dict(SHORT_TILINGS if short_tilings is None else short_tilings)
        self.fused_rows = fused_rows
        self.fused_prefill_rows = fused_prefill_rows
        self.device_sampling = device_sampling
        self.weights = weights if isinstance(weights, TorchWeights) else load_weights(
            weights, config, self.device, self.dtype)
        self.lora = TorchLora(config, adapters, self.device) if adapters else None
        self.num_adapters = len(adapters)
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
            c, plan, self.device, self.dtype, has_wide_scratch=not has_f32,
            fused_rows=max(self.fused_rows, self.fused_prefill_rows) if has_fused else 0)
        self.prefill_stager = PrefillStager(
            max_tokens=pass_tokens(plan), max_chunks=plan.max_batch,
            pages=self.state.pages_per_seq, page_size=plan.page_size,
            scratch_page=plan.num_pages, device=self.device)
        self._bytes = self.state.nbytes + self.prefill_stager.nbytes + (
            self.lora.nbytes if self.lora is not None else 0)
        ops = TorchOps(c, plan.page_size)
        if self.kernels == "triton":
            from llm_runner_svc.engines.torch_triton import TritonOps

            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 1)
            ops = TritonOps(c, plan.page_size, num_sms, has_fused, self.split_prefill_keys)
            self._bytes += ops.reserve(plan.max_decode_rows, plan.max_seq, self.device)
        short = self._short_products()
        self.forward = Forward(c, self.weights, ops, self.state, plan.hidden_layer,
                               plan.page_size, has_f32, self.fused_rows,
                               self.fused_prefill_rows, self.lora, short,
                               self.short_prefill_rows)
        self.stager = InputStager(self.state, scratch_page=plan.num_pages)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self._plan = plan
        if self.device.type == "cuda" and self.kernels == "triton":
            with torch.cuda.device(self.device):
                self.graphs = DecodeGraphs(self.forward, self.state, plan.max_batch,
                                           capture_hidden=plan.hidden_layer is not None,
                                           verify_tokens=plan.verify_tokens)
                self.graphs.capture()
                buckets = prefill_buckets(self.prefill_stager.max_tokens,
                                          self.prefill_graph_tokens)
                if buckets:
                    self.prefill_graphs = PrefillGraphs(
                        self.forward, self.prefill_stager, buckets,
                        capture_hidden=plan.hidden_layer is not None, pad_dest=plan.max_batch)
                    self.prefill_graphs.capture()
        self.picks = Picks(self.state.logits, self.state.next_ids,
                           max(pass_tokens(plan), plan.max_decode_rows), plan.max_batch,
                           min(SCORE_CHUNK, plan.max_decode_rows), self.device_sampling)
        self._bytes += self.picks.nbytes
        self._last_sampled: tuple[bool, ...] = ()  # which rows of the last forward picked

    def _short_products(self) -> ShortProducts | None:
        """The short passes' products with their partials claimed (None: not used here):
        with triton kernels on bf16 weights (or on the CPU, where triton kernels run on
        Triton's interpreter: the tests)."""
        if not (self.short_prefill_rows > self.fused_prefill_rows and self.kernels == "triton"
                and (self.dtype == torch.bfloat16 or self.device.type == "cpu")):
            return None
        from llm_runner_svc.engines.torch_triton_short import ShortProducts

        short = ShortProducts(self.config.rms_eps, self.short_tilings)
        self._bytes += short.reserve(self.device)
        return short

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


