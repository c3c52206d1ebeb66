"""Vision towers of vision-language models: architecture facts and host float32 weights.

The LLaVA family (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision transformer,
whose hidden states at `vision_feature_layer` (one layer or several, concatenated) become,
through the two-layer multimodal projector, one text embedding per image token.
Idefics3 / SmolVLM (`Idefics3ForConditionalGeneration`): a SigLIP-style tower with its
post-layernorm, then the connector: pixel shuffle (each scale x scale block of patches as one
token of scale^2 the width) and one linear projection. Weights are
[out, in] as in the checkpoint; the forward passes live in engines/ (numpy_vision.py,
torch_vision.py). Tensor names are taken with or without the `model.` / `vision_model.`
prefixes the different transformers versions write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_runner_svc.errors import ModelFormatError, Unimplemented

TOWERS = ("clip_vision_model", "siglip_vision_model", "idefics3_vision")
CONNECTORS = ("mlp2", "pixel_shuffle")  # LLaVA's projector, Idefics3's connector
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower and its projector; validated on construction."""

    tower: str  # one of TOWERS
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]  # hidden_states indices, concatenated in this order
    drop_cls: bool  # vision_feature_select_strategy "default": the first position dropped
    projector_act: str
    text_hidden_size: int
    image_token_id: int
    post_norm: bool = False  # the tower's post_layernorm on its last layer (Idefics3)
    connector: str = "mlp2"
    scale_factor: int = 1  # pixel shuffle's

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise Unimplemented(f"vision connector {self.connector!r} is not supported")
        if self.tower not in TOWERS:
            raise Unimplemented(f"vision tower {self.tower!r} is not supported "
                                f"(supported: {', '.join(TOWERS)})")
        for act in (self.hidden_act, self.projector_act):
            if act not in ACTIVATIONS:
                raise Unimplemented(f"vision activation {act!r} is not supported")
        if self.hidden_size % self.num_heads or self.image_size % self.patch_size:
            raise ModelFormatError("vision config: hidden_size must split into heads and "
                                   "image_size into patches")
        for layer in self.feature_layers:
            if not -self.num_layers - 1 <= layer <= self.num_layers:
                raise ModelFormatError(f"vision_feature_layer {layer} is outside the tower's "
                                       f"{self.num_layers} layers")

    @property
    def has_cls(self) -> bool:
        return self.tower == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Positions of the tower's sequence: the patches, and CLIP's class token."""
        return self.num_patches + int(self.has_cls)

    @property
    def tokens_per_image(self) -> int:
        """Image tokens one image becomes in the text sequence."""
        if self.connector == "pixel_shuffle":
            return self.num_patches // self.scale_factor ** 2
        return self.num_positions - int(self.drop_cls)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class VisionLayer:
    """One encoder layer, float32, matrices [out, in]."""

    ln1_w: np.ndarray  # [hidden]
    ln1_b: np.ndarray  # [hidden]
    wq: np.ndarray  # [hidden, hidden]
    bq: np.ndarray  # [hidden]
    wk: np.ndarray  # [hidden, hidden]
    bk: np.ndarray  # [hidden]
    wv: np.ndarray  # [hidden, hidden]
    bv: np.ndarray  # [hidden]
    wo: np.ndarray  # [hidden, hidden]
    bo: np.ndarray  # [hidden]
    ln2_w: np.ndarray  # [hidden]
    ln2_b: np.ndarray  # [hidden]
    fc1_w: np.ndarray  # [intermediate, hidden]
    fc1_b: np.ndarray  # [intermediate]
    fc2_w: np.ndarray  # [hidden, intermediate]
    fc2_b: np.ndarray  # [hidden]


@dataclass
class VisionWeights:
    """The tower (up to its last feature layer) and the projector, float32 on the host."""

    patch_w: np.ndarray  # [hidden, channels * patch * patch] (the conv kernel, flattened)
    patch_b: np.ndarray | None  # [hidden] (SigLIP)
    cls: np.ndarray | None  # [hidden] (CLIP)
    pos: np.ndarray  # [num_positions, hidden]
    pre_ln: tuple[np.ndarray, np.ndarray] | None  # CLIP's pre_layrnorm (weight, bias)
    layers: list[VisionLayer]
    proj1_w: np.ndarray  # [text_hidden, hidden * num feature layers (or * scale^2)]
    proj1_b: np.ndarray | None  # [text_hidden] (LLaVA)
    proj2_w: np.ndarray | None  # [text_hidden, text_hidden] (LLaVA)
    proj2_b: np.ndarray | None  # [text_hidden] (LLaVA)
    post_ln: tuple[np.ndarray, np.ndarray] | None = None  # Idefics3's post_layernorm


@dataclass
class VisionModel:
    """What a vision-language loader adds to a Model: the tower and how images are fed."""

    config: VisionConfig
    weights: VisionWeights
    preprocess: Mapping[str, Any]  # preprocessor_config.json (image_processing.py reads it)
    image_token: str  # the placeholder's text, as the chat template writes it
    wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # token ids put before and
    # after each image's tokens (Idefics3: <fake_token_around_image><global-img> ... )


def vision_config(cfg: Mapping[str, Any], text_hidden: int, where: str) -> VisionConfig:
    """The VisionConfig of a LLaVA or Idefics3 config.json."""
    vc = cfg.get("vision_config") or {}
    if cfg.get("model_type") == "idefics3":
        try:
            layers = int(vc["num_hidden_layers"])
            return VisionConfig(
                tower="idefics3_vision", hidden_size=int(vc["hidden_size"]),
                intermediate_size=int(vc["intermediate_size"]), num_layers=layers,
                num_heads=int(vc["num_attention_heads"]), image_size=int(vc["image_size"]),
                patch_size=int(vc["patch_size"]), num_channels=int(vc.get("num_channels", 3)),
                layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
                hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")),
                feature_layers=(layers,), drop_cls=False, projector_act="gelu",
                text_hidden_size=text_hidden, image_token_id=int(cfg["image_token_id"]),
                post_norm=True, connector="pixel_shuffle",
                scale_factor=int(cfg.get("scale_factor", 2)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFormatError(f"{where}: bad or missing vision field ({exc})") from exc
    layer = cfg.get("vision_feature_layer", -2)
    try:
        return VisionConfig(
            tower=str(vc.get("model_type", "clip_vision_model")),
            hidden_size=int(vc["hidden_size"]), intermediate_size=int(vc["intermediate_size"]),
            num_layers=int(vc["num_hidden_layers"]), num_heads=int(vc["num_attention_heads"]),
            image_size=int(vc["image_size"]), patch_size=int(vc["patch_size"]),
            num_channels=int(vc.get("num_channels", 3)),
            layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5 if vc.get(
                "model_type", "clip_vision_model") == "clip_vision_model" else 1e-6)),
            hidden_act=str(vc.get("hidden_act", "quick_gelu")),
            feature_layers=tuple(int(x) for x in layer) if isinstance(layer, list)
            else (int(layer),),
            drop_cls=cfg.get("vision_feature_select_strategy", "default") == "default",
            projector_act=str(cfg.get("projector_hidden_act", "gelu")),
            text_hidden_size=text_hidden,
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", -1))))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"{where}: bad or missing vision field ({exc})") from exc


def vision_name(name: str) -> str | None:
    """A checkpoint tensor's name inside the tower or projector ("tower." / "projector."
    prefixed), or None for a tensor of the text model."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("vision_tower."):
        rest = name[len("vision_tower."):]
        return "tower." + rest.removeprefix("vision_model.")
    if name.startswith("vision_model."):
        return "tower." + name[len("vision_model."):]
    if name.startswith("multi_modal_projector."):
        return "projector." + name[len("multi_modal_projector."):]
    if name.startswith("connector.modality_projection."):
        return "projector." + name[len("connector.modality_projection."):]
    return None


def text_name(name: str) -> str:
    """A LLaVA checkpoint's text-model tensor under the plain decoder's name."""
    for prefix in ("language_model.model.", "model.language_model.", "model.text_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name.removeprefix("language_model.")


def vision_weights(config: VisionConfig, tensors: Mapping[str, np.ndarray],
                   where: str) -> VisionWeights:
    """The tower's weights from checkpoint `tensors` (any prefix style); layers past the
    deepest feature layer are not needed and not kept."""
    named = {n: t for k, t in tensors.items() if (n := vision_name(k)) is not None}
    c = config

    def get(name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        arr = named.get(name)
        if arr is None:
            raise ModelFormatError(f"{where}: tensor {name} of the vision model is missing")
        if shape is not None and tuple(arr.shape) != shape:
            raise ModelFormatError(f"{where}: {name} has shape {tuple(arr.shape)}, "
                                   f"expected {shape}")
        return np.ascontiguousarray(arr, dtype=np.float32)

    h, ff = c.hidden_size, c.intermediate_size
    depth = max(f if f >= 0 else c.num_layers + 1 + f for f in c.feature_layers)
    layers = []
    for i in range(depth):
        p = f"tower.encoder.layers.{i}."
        v = get
        layers.append(VisionLayer(
            ln1_w=v(p + "layer_norm1.weight", (h,)), ln1_b=v(p + "layer_norm1.bias", (h,)),
            wq=v(p + "self_attn.q_proj.weight", (h, h)), bq=v(p + "self_attn.q_proj.bias", (h,)),
            wk=v(p + "self_attn.k_proj.weight", (h, h)), bk=v(p + "self_attn.k_proj.bias", (h,)),
            wv=v(p + "self_attn.v_proj.weight", (h, h)), bv=v(p + "self_attn.v_proj.bias", (h,)),
            wo=v(p + "self_attn.out_proj.weight", (h, h)),
            bo=v(p + "self_attn.out_proj.bias", (h,)),
            ln2_w=v(p + "layer_norm2.weight", (h,)), ln2_b=v(p + "layer_norm2.bias", (h,)),
            fc1_w=v(p + "mlp.fc1.weight", (ff, h)), fc1_b=v(p + "mlp.fc1.bias", (ff,)),
            fc2_w=v(p + "mlp.fc2.weight", (h, ff)), fc2_b=v(p + "mlp.fc2.bias", (h,))))
    k = c.num_channels * c.patch_size ** 2
    patch = get("tower.embeddings.patch_embedding.weight",
                (h, c.num_channels, c.patch_size, c.patch_size)).reshape(h, k)
    th = c.text_hidden_size
    post_ln = (get("tower.post_layernorm.weight", (h,)), get("tower.post_layernorm.bias", (h,))) \
        if c.post_norm else None
    if c.connector == "pixel_shuffle":
        return VisionWeights(
            patch_w=np.ascontiguousarray(patch),
            patch_b=get("tower.embeddings.patch_embedding.bias", (h,)), cls=None,
            pos=get("tower.embeddings.position_embedding.weight", (c.num_positions, h)),
            pre_ln=None, layers=layers,
            proj1_w=get("projector.proj.weight", (th, h * c.scale_factor ** 2)),
            proj1_b=None, proj2_w=None, proj2_b=None, post_ln=post_ln)
    return VisionWeights(
        patch_w=np.ascontiguousarray(patch),
        patch_b=None if c.has_cls else get("tower.embeddings.patch_embedding.bias", (h,)),
        cls=get("tower.embeddings.class_embedding", (h,)) if c.has_cls else None,
        pos=get("tower.embeddings.position_embedding.weight", (c.num_positions, h)),
        pre_ln=(get("tower.pre_layrnorm.weight", (h,)), get("tower.pre_layrnorm.bias", (h,)))
        if c.has_cls else None,
        layers=layers,
        proj1_w=get("projector.linear_1.weight", (th, h * len(c.feature_layers))),
        proj1_b=get("projector.linear_1.bias", (th,)),
        proj2_w=get("projector.linear_2.weight", (th, th)),
        proj2_b=get("projector.linear_2.bias", (th,)))


def image_starts(prompt_ids: Sequence[int], image_token_id: int,
                 tokens_per_image: Sequence[int]) -> list[int]:
    """Where each image's placeholder run begins: the prompt's placeholders, in order, cut
    into runs of `tokens_per_image[i]`; ModelFormatError when they do not add up."""
    where = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(where) != sum(tokens_per_image):
        raise ModelFormatError(f"the prompt holds {len(where)} image tokens, the images need "
                               f"{sum(tokens_per_image)}")
    starts, at = [], 0
    for n in tokens_per_image:
        run = where[at:at + n]
        if run and run[-1] - run[0] != n - 1:
            raise ModelFormatError("an image's tokens are not consecutive in the prompt")
        starts.append(run[0] if run else 0)
        at += n
    return starts
