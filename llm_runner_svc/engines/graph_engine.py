"""A graph engine: our exported ONNX decoder step, run by an executor, inside the runtime.

The engine side (this module) is executor-independent: it owns the host KV pages
(`graph_kv`), the logits and the sampler, and turns prefill / decode calls into graph steps.
Picks, their processing (penalties, masks, min-p) and log-probabilities come from the host
code every host engine shares (batched.py); prompt scores do not, as the graphs give only each
row's last logits. An executor (onnxruntime, TensorRT) only runs one step on host feeds and
returns host outputs; it is opened in `preallocate()` (when the hidden layer is known) and
closed in `close()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from llm_runner_svc.engines.base import EnginePlan, is_same_plan
from llm_runner_svc.engines.batch import Pass
from llm_runner_svc.engines.batched import BatchedEngine
from llm_runner_svc.engines.graph_kv import HostKvPool, decode_inputs, prefill_inputs
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


class GraphEngine(BatchedEngine):
    """Shared prefill / decode / sample over a `StepExecutor` chosen by the subclass."""

    supports_verify = False  # its graphs give only each row's last logits,
    supports_scores = False  # so neither verify picks nor prompt scores

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
        super().close()

    def memory_bytes(self) -> int:
        return 0 if self._plan is None else self._kv.nbytes + self._logits.nbytes

    def _need_plan(self) -> tuple[EnginePlan, StepExecutor]:
        if self._plan is None or self._executor is None:
            raise FailedPrecondition("engine used before preallocate()")
        return self._plan, self._executor

    # ---- forward ---------------------------------------------------------------------
    def _run(self, p: Pass) -> tuple[np.ndarray, np.ndarray] | None:
        """Each segment of several tokens as one prefill call of the graph, the one-token
        segments together as one decode call."""
        plan, executor = self._need_plan()
        hidden = self.config.hidden_size
        n = p.num_tokens
        caps = (np.zeros((n, hidden), np.float32), np.zeros((n, hidden), np.float32)) \
            if p.capture else None
        ones = [s for s in p.segments if len(s.tokens) == 1]
        for s in p.segments:
            if len(s.tokens) == 1:
                continue
            first = s.start
            rows = self._kv.pool_rows(s.pages, first + len(s.tokens))  # [positions]
            feeds = prefill_inputs(s.tokens, first)
            feeds.update(self._kv.past_feeds(rows[None, :first]))
            out = executor.run(feeds, "prefill")
            self._kv.write_new(out, rows[None, first:])
            if s.wants_logits:
                self._logits[s.row] = out[sig.LOGITS][0]
            if caps is not None:
                span = slice(s.offset, s.offset + len(s.tokens))
                caps[0][span], caps[1][span] = out[sig.HIDDEN_EMBED][0], out[sig.HIDDEN_STATE][0]
        if ones:
            b = len(ones)
            pos = np.fromiter((s.start for s in ones), dtype=np.int64, count=b)  # [b]
            past = int(pos.max())
            windows = np.stack([self._kv.pool_rows(s.pages, past + 1) for s in ones])
            feeds = decode_inputs([s.tokens[0] for s in ones], pos)
            feeds.update(self._kv.past_feeds(windows[:, :past]))
            out = executor.run(feeds, "decode")
            self._kv.write_new(out, windows[np.arange(b), pos][:, None])
            self._logits[[s.row for s in ones]] = out[sig.LOGITS]
            if caps is not None:
                at = [s.offset for s in ones]
                caps[0][at], caps[1][at] = out[sig.HIDDEN_EMBED][:, 0], out[sig.HIDDEN_STATE][:, 0]
        return caps
