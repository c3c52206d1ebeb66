"""The IO contract of an exported decoder step: tensor names, dtypes and symbolic shapes.

One step runs `seq` new positions for each of `batch` rows on top of `past` cached positions
(`total = past + seq`). Per layer the graph reads the cached keys and values of the rows and
returns only the keys and values of the new positions; the caller owns the cache. Logits are
those of each row's last position. With a hidden layer, the graph also returns the layer-0
embeddings and the chosen layer's states of every new position.

Everything here is plain Python, shared by the exporter, the engines and the plan sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.spec import ModelConfig


class GraphDtype(StrEnum):
    """Weight and KV precision of an export; norms, softmax and the residual stay float32."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: str) -> GraphDtype:
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(
                f"dtype {value!r} is not one of {[d.value for d in cls]}") from None

    @property
    def element(self) -> str:
        """The element type name used in the IO description."""
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[self.value]


INPUT_IDS = "input_ids"  # [batch, seq] int64
POSITION_IDS = "position_ids"  # [batch, seq] int64
ATTENTION_BIAS = "attention_bias"  # [batch, 1, 1, seq, total] float32, 0 = visible
LOGITS = "logits"  # [batch, vocab] float32, each row's last position
HIDDEN_EMBED = "hidden_embed"  # [batch, seq, hidden] float32, layer-0 (token embedding) output
HIDDEN_STATE = "hidden_state"  # [batch, seq, hidden] float32 at accept_hidden_layer


def past_key(layer: int) -> str:
    return f"past_key.{layer}"  # [batch, kv_heads, past, head_dim] kv dtype


def past_value(layer: int) -> str:
    return f"past_value.{layer}"  # [batch, kv_heads, past, head_dim] kv dtype


def new_key(layer: int) -> str:
    return f"new_key.{layer}"  # [batch, kv_heads, seq, head_dim] kv dtype, RoPE applied


def new_value(layer: int) -> str:
    return f"new_value.{layer}"  # [batch, kv_heads, seq, head_dim] kv dtype


@dataclass(frozen=True)
class TensorDesc:
    """One graph input or output; dims are ints or the names of dynamic axes."""

    name: str
    element: str  # numpy-style element type name
    dims: tuple[int | str, ...]
    is_input: bool

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "dtype": self.element, "dims": list(self.dims),
                "mode": "input" if self.is_input else "output"}


def io_tensors(config: ModelConfig, dtype: GraphDtype, has_hidden: bool) -> list[TensorDesc]:
    """Every input then every output of the step graph, in graph order."""
    kv = (("batch", config.num_kv_heads, "past", config.head_dim),
          ("batch", config.num_kv_heads, "seq", config.head_dim))
    ins = [TensorDesc(INPUT_IDS, "int64", ("batch", "seq"), True),
           TensorDesc(POSITION_IDS, "int64", ("batch", "seq"), True),
           TensorDesc(ATTENTION_BIAS, "float32", ("batch", 1, 1, "seq", "total"), True)]
    outs = [TensorDesc(LOGITS, "float32", ("batch", config.vocab_size), False)]
    for i in range(config.num_layers):
        ins += [TensorDesc(past_key(i), dtype.element, kv[0], True),
                TensorDesc(past_value(i), dtype.element, kv[0], True)]
        outs += [TensorDesc(new_key(i), dtype.element, kv[1], False),
                 TensorDesc(new_value(i), dtype.element, kv[1], False)]
    if has_hidden:
        hidden = ("batch", "seq", config.hidden_size)
        outs += [TensorDesc(HIDDEN_EMBED, "float32", hidden, False),
                 TensorDesc(HIDDEN_STATE, "float32", hidden, False)]
    return ins + outs
