"""`synthetic`: an engine with no model math, for benchmarks and load tests of the service path.

It produces no real text. Each row's pick is a hash of the row's last position and last input
token, mapped into the model's ordinary token ids (no BOS or EOS, none of the lowest ids, which
are special or single bytes in llama2.c vocabularies), so a request runs to its max_tokens and
the text decoder always gets whole pieces; a pick never depends on the batch mates, the row's
index or the sampling settings. A step costs `step_ms` plus `token_us` per token of the batch,
waited for in `read` with `time.sleep`, which releases the GIL as a thread waiting on a GPU
does. Steps run one at a time from their launch, as a device works through its queue, so the
runtime's launch-then-read-the-previous overlap hides the host's work as it does on a GPU.
What it measures: the scheduler, the runtime, the stage and gRPC at a chosen step time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_runner_svc.engines.base import (
    Engine,
    EnginePlan,
    SampleSpec,
    check_batch,
    is_same_plan,
    resolve_tokens,
)
from llm_runner_svc.engines.batch import Batch, StepOutput
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, Unimplemented
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

DEFAULT_STEP_MS = 1.0  # a step's fixed cost (syntheticStepMs)
DEFAULT_TOKEN_US = 0.0  # its cost per batch token (syntheticTokenUs), so prefill costs more
# Below this id a llama2.c vocabulary holds unk, BOS, EOS and its 256 single-byte tokens, which
# may be half a UTF-8 character; Hugging Face vocabularies keep their special tokens there too.
FIRST_ORDINARY_ID = 259
_PICK_LOGIT = 30.0  # a pick's logit over zeros elsewhere: softmax puts ~all mass on it
_MASK64 = (1 << 64) - 1


def ordinary_ids(config: ModelConfig) -> tuple[int, ...]:
    """The ids a synthetic pick may take: from FIRST_ORDINARY_ID up (the upper half of a
    vocabulary no larger than that), without the model's BOS and EOS ids."""
    special = {*config.eos_ids, *(() if config.bos_id is None else (config.bos_id,))}
    size = config.vocab_size
    low = FIRST_ORDINARY_ID if size > FIRST_ORDINARY_ID else size // 2
    ids = tuple(i for i in range(low, size) if i not in special)
    if not ids:
        raise InvalidArgument(f"synthetic engine: a vocabulary of {config.vocab_size} ids "
                              "has no ordinary token to pick")
    return ids


def synthetic_pick(position: int, last_token: int, ids: Sequence[int]) -> int:
    """The pick after `last_token` at `position`: splitmix64's finaliser over the pair, one of
    `ids`. The same pair gives the same pick in any batch, after a preemption's recompute too."""
    z = (position * 0x9E3779B97F4A7C15 + last_token + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ids[(z ^ (z >> 31)) % len(ids)]


@dataclass(frozen=True)
class SyntheticStep:
    """The handle of one launch: its picks and when the device would be done with it."""

    picks: Sequence[int | None]  # per row; None for a row without a sample spec
    done_at: float  # time.perf_counter() seconds


def _duration(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"synthetic engine: {name} must be a finite number >= 0, "
                              f"got {value!r}")
    return float(value)


class SyntheticEngine(Engine):
    """Deterministic picks at a configured step time; holds no weights and no KV.

    The KV pool is still sized from the model (`kv_bytes_per_token`), so admission, paging
    and preemption behave as they would for a real engine of that model."""

    name = "synthetic"

    def __init__(self, config: ModelConfig, weights: ModelWeights | None = None,
                 step_ms: float = DEFAULT_STEP_MS, token_us: float = DEFAULT_TOKEN_US) -> None:
        """`weights` are not kept: nothing is computed from them."""
        self.config = config
        self.step_s = _duration("step_ms", step_ms) / 1e3
        self.token_s = _duration("token_us", token_us) / 1e6
        self._ids = ordinary_ids(config)
        self._plan: EnginePlan | None = None
        self._last_picks: Sequence[int | None] | None = None  # fed to `from_pick` rows
        self._row_picks: list[int] = []  # every row's pick of the last launch (logits rows)
        self._device_free_at = 0.0  # when the last launched step is done

    def preallocate(self, plan: EnginePlan) -> None:
        if is_same_plan(self._plan, plan):
            return
        if plan.hidden_layer is not None:
            raise Unimplemented("the synthetic engine computes no hidden states: a stage on "
                                "it cannot emit 'hidden' (accept_hidden_layer)")
        self._plan = plan

    def launch(self, batch: Batch) -> SyntheticStep:
        if self._plan is None:
            raise FailedPrecondition("engine used before preallocate()")
        check_batch(self.config, self._plan, batch, supports_embeds=False)
        for row in batch.rows:
            if row.verify or row.capture_hidden:
                raise Unimplemented("the synthetic engine verifies no proposals and captures "
                                    "no hidden states")
        tokens = resolve_tokens(batch, self._last_picks)
        self._row_picks = [synthetic_pick(row.end - 1, toks[-1], self._ids)
                           for row, toks in zip(batch.rows, tokens, strict=True)]
        picks = [p if row.sample is not None else None
                 for row, p in zip(batch.rows, self._row_picks, strict=True)]
        self._last_picks = picks
        # A step launched while the previous one still runs starts when that one ends.
        start = max(time.perf_counter(), self._device_free_at)
        self._device_free_at = start + self.step_s + self.token_s * batch.num_tokens
        return SyntheticStep(picks, self._device_free_at)

    def read(self, handle: SyntheticStep) -> StepOutput:
        wait_s = handle.done_at - time.perf_counter()
        if wait_s > 0:
            time.sleep(wait_s)
        return StepOutput(handle.picks, [None] * len(handle.picks))

    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        """The last launch's picks of rows 0 .. len(specs)-1; temperature, top-k/p and logit
        bias change nothing here."""
        self._check_rows(len(specs))
        return self._row_picks[:len(specs)]

    def logits(self, num_rows: int) -> np.ndarray:
        """[num_rows, vocab] float32: _PICK_LOGIT at each row's pick, 0 elsewhere. Built
        when asked: only the single-request tools read logits."""
        self._check_rows(num_rows)
        out = np.zeros((num_rows, self.config.vocab_size), np.float32)  # [rows, vocab]
        out[np.arange(num_rows), self._row_picks[:num_rows]] = _PICK_LOGIT
        return out

    def _check_rows(self, num_rows: int) -> None:
        if num_rows > len(self._row_picks):
            raise FailedPrecondition(f"logits rows 0..{num_rows - 1} asked; the last forward "
                                     f"had {len(self._row_picks)} rows")

    def close(self) -> None:
        self._last_picks = None
        self._row_picks = []
        self._device_free_at = 0.0
