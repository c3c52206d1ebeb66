"""Tiny random Hugging Face checkpoints, built locally with transformers (nothing downloaded).

`hf_model_dir(arch, tmp_path, **config_overrides)` writes config.json, model.safetensors,
tokenizer.json and tokenizer_config.json and returns the torch model it saved, in float32 and
eager attention, so tests can compare against it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MODEL_VOCAB = 320
TOKENIZER_VOCAB = 300  # 256 byte tokens + specials + a few merges, below the model's vocab

SENTENCES = [
    "Once upon a time there was a little robot who liked to count tokens.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Numpy and torch should agree on every logit.",
    "Attention is all you need, said the paper, and the world listened.",
] * 4

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Special tokens get ids 0, 1, ... in this order.
SPECIALS = {
    "llama": ["<s>", "</s>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.15,  # large enough that attention is far from uniform
)

ARCH_CONFIG: dict[str, dict[str, Any]] = {
    # llama: Llama tokens <s>=0, </s>=1; a non-default eps and theta to check the plumbing
    "llama": dict(bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5, rope_theta=50000.0),
    # qwen2: q/k/v bias; eos given as a list
    "qwen2": dict(num_hidden_layers=3, bos_token_id=0, eos_token_id=[2, 0],
                  rms_norm_eps=1e-6, rope_theta=1000000.0),
    # qwen3: q/k norm and a head_dim that is not hidden / heads
    "qwen3": dict(head_dim=32, bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-6,
                  rope_theta=1000000.0),
}


def write_tokenizer(path: Path, arch: str, vocab_size: int = TOKENIZER_VOCAB,
                    tokenizer_config: dict[str, Any] | None = None) -> Tokenizer:
    """Train a byte-level BPE on a few sentences; write tokenizer.json and
    tokenizer_config.json (Llama-style BOS/EOS or Qwen-style ChatML, unless given)."""
    specials = SPECIALS[arch]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is None:
        if arch == "llama":
            tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>"}
        else:
            tokenizer_config = {"bos_token": None, "eos_token": "<|im_end|>",
                                "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok


def _randomize(model: Any, seed: int) -> None:
    """transformers initialises norms to 1 and biases to 0; make them random so a loader or
    engine that drops them cannot pass."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def build_hf_model(arch: str, path: Path, seed: int = 0, dtype: Any = None,
                   save_kwargs: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """Save a random `arch` model (plus tokenizer) to `path`; return the float32 torch model.
    Skips the calling test where torch or transformers is not installed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = {**BASE_CONFIG, **ARCH_CONFIG[arch], **overrides}
    config = config_cls(**kwargs, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    saved = model if dtype is None else model.to(dtype)
    saved.save_pretrained(str(path), safe_serialization=True, **(save_kwargs or {}))
    write_tokenizer(path, arch)
    return saved.to(torch.float32).eval()


@pytest.fixture
def hf_model_dir(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    """Factory: hf_model_dir(arch, **overrides) -> (directory, torch model)."""

    def make(arch: str, name: str | None = None, **kwargs: Any) -> tuple[Path, Any]:
        path = tmp_path / (name or arch)
        return path, build_hf_model(arch, path, **kwargs)

    return make


def edit_json(path: Path, **changes: Any) -> None:
    """Rewrite one JSON file with some keys replaced (None values are kept as null)."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture
def edit_config() -> Callable[..., None]:
    return edit_json
