"""Tiny random LLaVA directories, built locally with transformers (nothing downloaded).

`build_llava(path, tower)` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (a chat template that places `<image>` for image parts) and
preprocessor_config.json, and returns the float32 eager torch model it saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 2  # specials: <s> 0, </s> 1, <image> 2, <fake_token_around_image> 3,
# <global-img> 4
IMAGE_SIZE = 16
PATCH = 4
TEXT_VOCAB = 320
SENTENCES = [
    "Describe the image. What colour is the square in the picture?",
    "A cat sits on a mat; the quick brown fox jumps over the lazy dog.",
    "user assistant: how many objects are there in these two images?",
] * 4

LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

TOWERS: dict[str, dict[str, Any]] = {
    # CLIP: class token, pre-layernorm, quick_gelu; LLaVA drops the class token
    "clip": dict(cls=transformers.CLIPVisionConfig, strategy="default", layer=-2,
                 extra=dict(hidden_act="quick_gelu", projection_dim=32)),
    # SigLIP: no class token, patch bias, tanh gelu; every position kept; two feature layers
    "siglip": dict(cls=transformers.SiglipVisionConfig, strategy="full", layer=[-2, -1],
                   extra=dict(hidden_act="gelu_pytorch_tanh")),
}


def write_vlm_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[
        "<s>", "</s>", IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "image_token": IMAGE_TOKEN,
        "chat_template": LLAVA_TEMPLATE}))


def _randomize(model: Any, seed: int) -> None:
    """Norms and biases random too, so a loader or engine that drops one cannot pass."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layer_norm" in name and name.endswith("weight") \
                    or "layrnorm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias") or name.endswith("class_embedding"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def build_llava(path: Path, tower: str = "clip", text_arch: str = "llama", seed: int = 0,
                **text_overrides: Any) -> Any:
    """Save a random LLaVA (vision tower `tower`, text model `text_arch`) to `path`; return
    the float32 eager torch model."""
    t = TOWERS[tower]
    vision = t["cls"](hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                      **t["extra"])
    text_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[text_arch]
    text = text_cls(vocab_size=TEXT_VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                    initializer_range=0.15, **text_overrides)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
        vision_feature_select_strategy=t["strategy"], vision_feature_layer=t["layer"],
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    write_vlm_tokenizer(path)
    clip_like = tower == "clip"
    (path / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "do_center_crop": clip_like, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True, "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": IMAGE_SIZE} if clip_like
        else {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "image_mean": [0.48145466, 0.4578275, 0.40821073] if clip_like else [0.5] * 3,
        "image_std": [0.26862954, 0.26130258, 0.27577711] if clip_like else [0.5] * 3}))
    return model


def build_idefics3(path: Path, seed: int = 0) -> Any:
    """Save a random Idefics3 (SigLIP-style tower, pixel shuffle 2, a Llama text model) to
    `path`; return the float32 eager torch model. Its processor settings ask for no tiles."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    text = dict(model_type="llama", vocab_size=TEXT_VOCAB, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                eos_token_id=1, initializer_range=0.15, tie_word_embeddings=True)
    config = transformers.Idefics3Config(vision_config=vision, text_config=text,
                                         image_token_id=IMAGE_TOKEN_ID, scale_factor=2,
                                         tie_word_embeddings=True,
                                         attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    write_vlm_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 1,
        "do_image_splitting": False, "size": {"longest_edge": IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return model
