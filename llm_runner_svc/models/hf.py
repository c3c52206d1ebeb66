"""Hugging Face model directories: config.json, safetensors weights, tokenizer.json.

Supports the Llama family as transformers writes it: model_type llama (SmolLM too), qwen2
(q/k/v bias) and qwen3 (per-head q/k RMSNorm). Linear weights are [out, in] already; RoPE
rotates halves. bf16 tensors are widened to float32 from their raw bytes. A LLaVA directory
(model_type llava) or an Idefics3 / SmolVLM one (idefics3) is its text model (`text_config`)
plus a vision tower (models/vision.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from jinja2 import TemplateError
from safetensors import SafetensorError, safe_open

import llm_runner_svc.models.progress as load_progress
from llm_runner_svc.errors import ModelFormatError, NotFound, Unimplemented
from llm_runner_svc.models.chat import ChatTemplate
from llm_runner_svc.models.model import Model
from llm_runner_svc.models.spec import LayerWeights, ModelConfig, ModelWeights, RopeStyle
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.models.vision import (
    VisionModel,
    text_name,
    vision_config,
    vision_name,
    vision_weights,
)

ARCHS = ("llama", "qwen2", "qwen3")
VISION_LANGUAGE = ("llava", "idefics3")
# Idefics3's processor puts these around each image's tokens (an image not split in tiles)
_IDEFICS3_WRAP = ("<fake_token_around_image><global-img>", "<fake_token_around_image>")


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise NotFound(f"{path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of one file as float32; bf16 is widened from its raw bytes."""
    if not file.is_file():
        raise NotFound(f"weights file {file} does not exist")
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if f.get_slice(name).get_dtype() != "BF16":
                    out[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    except SafetensorError as exc:
        raise ModelFormatError(f"{file}: not a valid safetensors file ({exc})") from exc
    with file.open("rb") as fh:  # safe_open validated the header and the file's length
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] != "BF16":
                continue
            begin, end = info["data_offsets"]
            fh.seek(8 + n + begin)
            raw = np.frombuffer(fh.read(end - begin), dtype="<u2").astype(np.uint32) << 16
            out[name] = raw.view(np.float32).reshape(info["shape"])
    return out


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{index}: no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise NotFound(f"{path}: no *.safetensors weights (model.safetensors or shards)")
    tensors: dict[str, np.ndarray] = {}
    load_progress.start(sum(f.stat().st_size for f in files if f.is_file()), path.name)
    for f in files:
        tensors.update(_load_safetensors(f))
        load_progress.advance(f.stat().st_size)
    return tensors


def _check_supported(cfg: dict[str, Any], where: Path) -> str:
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        raise Unimplemented(f"{where}: model_type {arch!r} is not supported "
                            f"(supported: {', '.join(ARCHS)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise Unimplemented(f"{where}: hidden_act {act!r} is not supported (only silu)")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise Unimplemented(f"{where}: {key} type {kind!r} is not supported (only default)")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise Unimplemented(f"{where}: sliding window attention is not supported")
    if cfg.get("mlp_bias"):
        raise Unimplemented(f"{where}: mlp_bias is not supported")
    return str(arch)


class HfTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`; BOS is prepended by us, never by its post-processor."""

    def __init__(self, tok: tokenizers.Tokenizer, bos_id: int | None, eos_ids: tuple[int, ...],
                 add_bos: bool) -> None:
        self._tok = tok
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._add_bos = add_bos and bos_id is not None
        self._special_ids = frozenset(i for i, added in tok.get_added_tokens_decoder().items()
                                      if added.special)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids | super().special_ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], after_bos: bool = False) -> str:
        keep = [i for i in ids if i != self.bos_id]
        return str(self._tok.decode(keep, skip_special_tokens=False))

    def default_add_bos(self) -> bool:
        return self._add_bos

    def tokenizers_json(self) -> str | None:
        return str(self._tok.to_str())


def _load_tokenizer(path: Path, cfg: dict[str, Any], arch: str,
                    tok_cfg: dict[str, Any]) -> HfTokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise NotFound(f"{path}: tokenizer.json is missing")
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ModelFormatError(f"{file}: cannot be read as a tokenizer ({exc})") from exc
    if "bos_token" in tok_cfg:
        text = _token_text(tok_cfg["bos_token"])
        bos_id = tok.token_to_id(text) if text is not None else None
    else:
        bos_id = next(iter(_ids(cfg.get("bos_token_id"))), None)
    gen_cfg = _read_json(path / "generation_config.json", required=False)
    eos = _ids(cfg.get("eos_token_id")) + _ids(gen_cfg.get("eos_token_id"))
    eos_text = _token_text(tok_cfg.get("eos_token"))
    if eos_text is not None and (eos_tid := tok.token_to_id(eos_text)) is not None:
        eos.append(eos_tid)
    add_bos = tok_cfg.get("add_bos_token", arch == "llama")
    return HfTokenizer(tok, bos_id, tuple(dict.fromkeys(eos)), bool(add_bos))


def _chat_template(path: Path, tok_cfg: dict[str, Any]) -> ChatTemplate | None:
    source: Any = tok_cfg.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        source = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    try:
        return ChatTemplate(source, _token_text(tok_cfg.get("bos_token")) or "",
                            _token_text(tok_cfg.get("eos_token")) or "")
    except TemplateError as exc:
        raise ModelFormatError(f"{path}: chat template does not compile ({exc})") from exc


def _preprocessor(path: Path) -> dict[str, Any]:
    """The image processor's settings: preprocessor_config.json, or the image_processor
    entry of processor_config.json (newer transformers)."""
    pre = _read_json(path / "preprocessor_config.json", required=False)
    if not pre:
        nested = _read_json(path / "processor_config.json", required=False)
        pre = nested.get("image_processor") or {}
    return pre if isinstance(pre, dict) else {}


def load_vision(path: Path, text_hidden: int | None = None) -> VisionModel:
    """The vision tower and projector of a LLaVA directory (the text model's weights need
    not be there: `multimodal_artifact` may name a directory holding only the tower)."""
    where = path / "config.json"
    cfg = _read_json(where)
    if cfg.get("model_type") not in VISION_LANGUAGE:
        raise Unimplemented(f"{where}: model_type {cfg.get('model_type')!r} has no vision "
                            f"tower this runner supports ({', '.join(VISION_LANGUAGE)})")
    hidden = text_hidden or int((cfg.get("text_config") or {}).get("hidden_size", 0))
    tensors = {k: v for k, v in _load_tensors(path).items() if vision_name(k) is not None}
    return _vision(path, cfg, hidden, tensors)


def _vision(path: Path, cfg: dict[str, Any], text_hidden: int,
            tensors: dict[str, np.ndarray]) -> VisionModel:
    where = str(path / "config.json")
    vc = vision_config(cfg, text_hidden, where)
    tok_cfg = _read_json(path / "tokenizer_config.json", required=False)
    proc_cfg = _read_json(path / "processor_config.json", required=False)
    token = _token_text(tok_cfg.get("image_token")) or _token_text(
        proc_cfg.get("image_token")) or "<image>"
    wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    if cfg.get("model_type") == "idefics3" and (path / "tokenizer.json").is_file():
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        ids = [tuple(tok.encode(t, add_special_tokens=False).ids) for t in _IDEFICS3_WRAP]
        if tok.token_to_id("<fake_token_around_image>") is not None:
            wrap = (ids[0], ids[1])
    return VisionModel(vc, vision_weights(vc, tensors, where), _preprocessor(path), token,
                       wrap)


def load_hf(path: Path, vision_path: Path | None = None) -> Model:
    """Load a Hugging Face directory; NotFound for missing files, ModelFormatError for bad
    ones, Unimplemented for architectures or options this runner cannot honour. A LLaVA
    directory brings its vision tower; `vision_path` names another directory holding it."""
    outer = _read_json(path / "config.json")
    cfg = outer
    if outer.get("model_type") in VISION_LANGUAGE:
        cfg = outer.get("text_config") or {}
        if not isinstance(cfg, dict):
            raise ModelFormatError(f"{path / 'config.json'}: text_config is not an object")
    arch = _check_supported(cfg, path / "config.json")
    tok_cfg = _read_json(path / "tokenizer_config.json", required=False)
    tokenizer = _load_tokenizer(path, cfg, arch, tok_cfg)
    tensors = _load_tensors(path)
    if cfg is not outer:
        tensors = {text_name(k) if vision_name(k) is None else k: v for k, v in tensors.items()}
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        config = ModelConfig(
            arch=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position=int(cfg["max_position_embeddings"]),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_style=RopeStyle.HALF, rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            has_qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias")),
            has_qk_norm=arch == "qwen3", tie_embeddings=bool(cfg.get("tie_word_embeddings")),
            bos_id=tokenizer.bos_id, eos_ids=tokenizer.eos_ids)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"{path / 'config.json'}: bad or missing field ({exc})") from exc

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelFormatError(f"{path}: tensor {name} is missing")
        return tensors[name]

    def opt(name: str, wanted: bool) -> np.ndarray | None:
        return get(name) if wanted else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        o_bias = tensors.get(p + "self_attn.o_proj.bias")
        if o_bias is not None and np.any(o_bias):
            raise Unimplemented(f"{path}: a bias on o_proj is not supported")
        qkv, qk = config.has_qkv_bias, config.has_qk_norm
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"), wq=get(p + "self_attn.q_proj.weight"),
            wk=get(p + "self_attn.k_proj.weight"), wv=get(p + "self_attn.v_proj.weight"),
            wo=get(p + "self_attn.o_proj.weight"),
            ffn_norm=get(p + "post_attention_layernorm.weight"),
            w_gate=get(p + "mlp.gate_proj.weight"), w_up=get(p + "mlp.up_proj.weight"),
            w_down=get(p + "mlp.down_proj.weight"),
            bq=opt(p + "self_attn.q_proj.bias", qkv), bk=opt(p + "self_attn.k_proj.bias", qkv),
            bv=opt(p + "self_attn.v_proj.bias", qkv), q_norm=opt(p + "self_attn.q_norm.weight", qk),
            k_norm=opt(p + "self_attn.k_norm.weight", qk)))
    weights = ModelWeights(
        embedding=get("model.embed_tokens.weight"), layers=layers,
        final_norm=get("model.norm.weight"),
        lm_head=None if config.tie_embeddings else get("lm_head.weight"))
    weights.check(config)
    vision = None
    if vision_path is not None:
        vision = load_vision(vision_path, config.hidden_size)
    elif cfg is not outer:
        vision = _vision(path, outer, config.hidden_size, tensors)
    return Model(name=path.name, format="hf", config=config, weights=weights,
                 tokenizer=tokenizer, chat_template=_chat_template(path, tok_cfg),
                 vision=vision)
