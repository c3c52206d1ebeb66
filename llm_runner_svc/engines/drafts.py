"""Draft engines for speculative decoding (runtime/drafting.py proposes with them).

`self` (layer skip): the target's first N decoder layers with its final norm and head, a
model of N layers over the same weights (the torch engine shares the target's tensors, the
numpy engine keeps its own copies of those layers). `draft`: a separate small model, which
must tokenize exactly as the target does; a mismatch is refused at start, named.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import Engine
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models import Model, load_model
from llm_runner_svc.models.tokenizer import Tokenizer

# Text whose token ids two tokenizers must agree on to be taken as the same.
PROBE = ("The quick brown fox jumps over the lazy dog. 1234567890 !?;: "
         "Once upon a time, naïve café owners said: \"Hello, world!\"\n\tdef f(x): return x")


def first_layers(target: Engine, num_layers: int) -> Engine:
    """`target`'s first `num_layers` layers with its final norm and head, as an engine (the
    torch engine's on the same tensors)."""
    if target.name != "torch":
        raise InvalidArgument(f"engine {target.name}: layer-skip drafts are built from its "
                              "model (create_draft_engine)")
    return _torch_first_layers(target, num_layers)


def create_draft_engine(method: str, engine_name: str, model: Model, target: Engine,
                        draft_layers: int = 0, draft_checkpoint: str = "",
                        **options: Any) -> Engine | None:
    """The draft engine for spec_decode `method` on `engine_name` (the target's engine,
    built from `model`); None for `ngram`, which needs none. `options` go to create_engine."""
    if method == "ngram":
        return None
    if method == "self":
        n = draft_layers
        if not 1 <= n < model.config.num_layers:
            raise InvalidArgument(f"spec_decode.draft_layers: the draft keeps 1 .. "
                                  f"{model.config.num_layers - 1} of the target's "
                                  f"{model.config.num_layers} layers, got {n}")
        if target.name == "torch":
            return _torch_first_layers(target, n)
        weights = replace(model.weights, layers=list(model.weights.layers[:n]))
        return create_engine(engine_name, replace(model.config, num_layers=n), weights,
                             **options)
    if method == "draft":
        small = load_model(draft_checkpoint)
        why = tokenizer_mismatch(model.tokenizer, small.tokenizer)
        if why is None and small.config.vocab_size != model.config.vocab_size:
            why = (f"its vocabulary has {small.config.vocab_size} tokens, the target's "
                   f"{model.config.vocab_size}")
        if why is not None:
            raise InvalidArgument(f"draft_checkpoint {draft_checkpoint}: not the target's "
                                  f"tokenizer: {why}")
        return create_engine(engine_name, small.config, small.weights, **options)
    raise InvalidArgument(f"spec_decode method {method!r} has no draft engine")


def tokenizer_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """How `draft` tokenizes differently from `target`, or None when they agree."""
    if draft.vocab_size != target.vocab_size:
        return f"{draft.vocab_size} token ids against the target's {target.vocab_size}"
    if draft.bos_id != target.bos_id:
        return f"BOS id {draft.bos_id} against the target's {target.bos_id}"
    if set(draft.eos_ids) != set(target.eos_ids):
        return f"end-of-sequence ids {sorted(draft.eos_ids)} against {sorted(target.eos_ids)}"
    a, b = target.encode(PROBE, add_bos=False), draft.encode(PROBE, add_bos=False)
    if a != b:
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        return f"a probe text encodes differently from token {i} on"
    if target.decode(a) != draft.decode(a):
        return "the same ids decode to different text"
    return None


def _torch_first_layers(target: Any, num_layers: int) -> Engine:
    """A torch engine of `target`'s first `num_layers` layers, its final norm and head, on
    the same weight tensors, with the same settings."""
    from llm_runner_svc.engines.torch_engine import TorchEngine
    from llm_runner_svc.engines.torch_weights import TorchWeights

    w = target.weights
    settings = {name: getattr(target, name) for name in (
        "kernels", "fused_rows", "fused_prefill_rows", "mixed_steps", "prefill_graph_tokens",
        "split_prefill_keys", "short_prefill_rows", "short_tilings") if hasattr(target, name)}
    dtype = "bfloat16" if target.dtype.itemsize == 2 else "float32"
    return TorchEngine(replace(target.config, num_layers=num_layers),
                       TorchWeights(w.embedding, w.lm_head, w.final_norm,
                                    w.layers[:num_layers]),
                       device=target.device, dtype=dtype, **settings)
