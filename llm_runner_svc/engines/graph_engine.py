"""A graph engine: our exported ONNX decoder step, run by an executor, inside the runtime.

The engine side (this module) is executor-independent: it owns the host KV pages
(`graph_kv`), the logits and the sampler, and turns prefill / decode calls into graph steps.
An executor (onnxruntime, TensorRT) only runs one step on host feeds and returns host
outputs; it is opened in `preallocate()` (when the hidden layer is known) and closed in
`close()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from llm_runner_svc.engines.base import (
    DecodeRow,
    Engine,
    EnginePlan,
    HiddenStates,
    SampleSpec,
    check_prefill_fits,
    check_token_ids,
    is_same_plan,
)
from llm_runner_svc.engines.graph_kv import HostKvPool, decode_inputs, prefill_inputs
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias, sample_rows
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.export import signature as sig
from llm_runner_svc.export.signature import GraphDtype
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

KV_DTYPES: dict[GraphDtype, type] = {GraphDtype.FP32: np.float32, GraphDtype.FP16: np.float16}


class StepExecutor(ABC):
    """Runs the step graph. `run` may be called any number of times between open and close."""

    @abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray], profile: str) -> dict[str, np.ndarray]:
        """One step on host inputs (every graph input); returns every graph output on the host.
        `profile` is "prefill" or "decode" (executors with shape profiles pick by it)."""

    @abstractmethod
    def close(self) -> None:
        """Release the executor's resources. Idempotent."""


class GraphEngine(Engine):
    """Shared prefill / decode / sample over a `StepExecutor` chosen by the subclass."""

    dtype: GraphDtype = GraphDtype.FP32

    def __init__(self, config: ModelConfig, weights: ModelWeights) -> None:
        weights.check(config)
        if self.dtype not in KV_DTYPES:
            raise InvalidArgument(f"engine {self.name}: dtype {self.dtype.value} has no host "
                                  f"KV type (use {', '.join(d.value for d in KV_DTYPES)})")
        self.config = config
        self.weights = weights
        self._plan: EnginePlan | None = None
        self._executor: StepExecutor | None = None

    @abstractmethod
    def _open_executor(self, plan: EnginePlan) -> StepExecutor:
        """Export or load the graph for `plan` and open its executor."""

    # ---- lifecycle -------------------------------------------------------------------
    def preallocate(self, plan: EnginePlan) -> None:
        if is_same_plan(self._plan, plan):
            return
        c = self.config
        # the export refuses a hidden layer the model does not have; a build's was checked
        # when it was exported
        self._executor = self._open_executor(plan)
        self._kv = HostKvPool(c, plan, KV_DTYPES[self.dtype])
        self._kv_pool = self._kv.pool  # [L, pages * page, (k | v) kv_dim]
        self._logits = np.zeros((plan.max_batch, c.vocab_size), np.float32)  # [batch, vocab]
        self._plan = plan

    def close(self) -> None:
        if self._plan is None:
            return
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        del self._kv, self._kv_pool, self._logits
        self._plan = None

    def memory_bytes(self) -> int:
        return 0 if self._plan is None else self._kv.nbytes + self._logits.nbytes

    def _need_plan(self) -> tuple[EnginePlan, StepExecutor]:
        if self._plan is None or self._executor is None:
            raise FailedPrecondition("engine used before preallocate()")
        return self._plan, self._executor

    # ---- forward ---------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int], start_pos: int, page_table: Sequence[int],
                capture_hidden: bool = False) -> HiddenStates | None:
        plan, executor = self._need_plan()
        n_total = len(token_ids)
        check_prefill_fits(plan, n_total, start_pos)
        check_token_ids(self.config, token_ids)
        rows = self._kv.pool_rows(page_table, start_pos + n_total)  # [positions]
        caps: list[tuple[np.ndarray, np.ndarray]] = []
        out: dict[str, np.ndarray] = {}
        for lo in range(0, n_total, plan.prefill_chunk):
            chunk = token_ids[lo:lo + plan.prefill_chunk]
            first = start_pos + lo
            feeds = prefill_inputs(chunk, first)
            feeds.update(self._kv.past_feeds(rows[None, :first]))
            out = executor.run(feeds, "prefill")
            self._kv.write_new(out, rows[None, first:first + len(chunk)])
            if capture_hidden:
                caps.append((out[sig.HIDDEN_EMBED][0], out[sig.HIDDEN_STATE][0]))
        self._logits[0] = out[sig.LOGITS][0]
        if not capture_hidden:
            return None
        return HiddenStates(embeddings=np.concatenate([e for e, _ in caps]),
                            states=np.concatenate([s for _, s in caps]),
                            start_position=start_pos)

    def decode(self, rows: Sequence[DecodeRow]) -> list[HiddenStates | None]:
        plan, executor = self._need_plan()
        b = len(rows)
        pos = np.fromiter((r.position for r in rows), dtype=np.int64, count=b)  # [b]
        if not 0 < b <= plan.max_batch or int(pos.max()) >= plan.max_seq:
            raise InvalidArgument(f"decode of {b} rows up to position {int(pos.max())}; "
                                  f"maxBatch is {plan.max_batch}, maxSeq {plan.max_seq}")
        ids = [r.token_id for r in rows]
        check_token_ids(self.config, ids)
        past = int(pos.max())
        windows = np.stack([self._kv.pool_rows(r.page_table, past + 1) for r in rows])
        feeds = decode_inputs(ids, pos)
        feeds.update(self._kv.past_feeds(windows[:, :past]))
        out = executor.run(feeds, "decode")
        self._kv.write_new(out, windows[np.arange(b), pos][:, None])
        self._logits[:b] = out[sig.LOGITS]
        if not any(r.capture_hidden for r in rows):
            return [None] * b
        emb, states = out[sig.HIDDEN_EMBED], out[sig.HIDDEN_STATE]  # [b, 1, hidden]
        return [HiddenStates(emb[i].copy(), states[i].copy(), int(pos[i]))
                if r.capture_hidden else None for i, r in enumerate(rows)]

    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        self._need_plan()
        apply_logit_bias(self._logits[:len(specs)], specs)
        return sample_rows(self._logits, specs)  # reads rows 0 .. len(specs)-1

    def logits(self, num_rows: int) -> np.ndarray:
        self._need_plan()
        return self._logits[:num_rows]

