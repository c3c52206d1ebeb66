"""LoRA adapters in the PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

An adapter adds `scale * B @ A` to some of a decoder's linear weights (W [out, in], A [r, in],
B [out, r]); `scale` is lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. The
target modules are the seven linear layers of a Llama-family decoder (q/k/v/o, gate/up/down)
under their Hugging Face names. Every check happens at load: an adapter whose rank, targets or
shapes do not fit the base model is refused naming the file and the rule, so a loaded adapter
always fits (`LoraAdapter`). Host arrays only; engines lay them out as they need.

PEFT adapters are made on Hugging Face models, whose RoPE rotates halves of a head. A model
whose RoPE rotates adjacent pairs (GGUF llama, llama2.c) holds q and k with each head's rows
permuted the way llama.cpp's converter does; the adapter's q/k lora_B rows (its output side)
are permuted the same way at load, so it changes those heads exactly as it does the HF model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from llm_runner_svc.errors import ModelFormatError
from llm_runner_svc.models.hf import _load_safetensors, _read_json
from llm_runner_svc.models.spec import ModelConfig, ModelWeights, RopeStyle

# PEFT module name -> LayerWeights field
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of the base weight a PEFT module name targets."""
    h, q, kv, ff = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (ff, h), "up_proj": (ff, h), "down_proj": (h, ff)}[module]


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter; `layers[i][module]` is (A [r, in], B [out, r]) float32, unscaled."""

    name: str
    rank: int
    scale: float
    targets: tuple[str, ...]  # PEFT module names, in MODULES order
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]

    def delta(self, layer: int, module: str) -> np.ndarray | None:
        """scale * B @ A [out, in] float32 for one target, None when not targeted."""
        pair = self.layers[layer].get(module)
        return None if pair is None else (self.scale * (pair[1] @ pair[0])).astype(np.float32)


def _targets(raw: Any, where: Path) -> tuple[str, ...]:
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or \
            not all(isinstance(n, str) for n in names):
        raise ModelFormatError(f"{where}: target_modules must be a non-empty list of names")
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        raise ModelFormatError(f"{where}: target_modules {unknown} are not among "
                               f"{sorted(MODULES)}")
    return tuple(m for m in MODULES if m in names)


def _interleave_heads(b: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of a q or k output [heads * head_dim, r] from halves order (HF) to adjacent pairs
    within each head (llama.cpp's `permute`)."""
    out, r = b.shape
    return b.reshape(num_heads, 2, out // num_heads // 2, r).swapaxes(1, 2).reshape(out, r)


# Settings of adapter_config.json that change what an adapter computes beyond W + s B A,
# with the value that means "off".
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
                "layers_to_transform": None, "fan_in_fan_out": False,
                "layer_replication": None, "target_parameters": None,
                "trainable_token_indices": None, "use_qalora": False,
                "alora_invocation_tokens": None}


def _check_supported(meta: dict[str, Any], where: Path) -> None:
    for key, off in _UNSUPPORTED.items():
        value = meta.get(key, off)
        if value != off and not (off is None and value == []):
            raise ModelFormatError(f"{where}: {key}={value!r} is not supported "
                                   f"(only {key}={off!r})")


def _scale(meta: dict[str, Any], where: Path) -> tuple[int, float]:
    r, alpha = meta.get("r"), meta.get("lora_alpha", meta.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ModelFormatError(f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ModelFormatError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    rslora = bool(meta.get("use_rslora", False))
    if meta.get("rank_pattern") or meta.get("alpha_pattern"):
        raise ModelFormatError(f"{where}: per-module rank_pattern/alpha_pattern is not "
                               "supported (one r and lora_alpha for every module)")
    return r, float(alpha) / (math.sqrt(r) if rslora else r)


def load_adapter(name: str, path: Path, cfg: ModelConfig) -> LoraAdapter:
    """Read the adapter directory `path` for a base model of shape `cfg`. Raises NotFound
    for a missing file and ModelFormatError (INVALID_ARGUMENT) naming the file and key for
    anything that does not fit."""
    meta_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    meta = _read_json(meta_file)
    if meta.get("peft_type", "LORA") != "LORA":
        raise ModelFormatError(f"{meta_file}: peft_type {meta.get('peft_type')!r} is not LORA")
    _check_supported(meta, meta_file)
    targets = _targets(meta.get("target_modules"), meta_file)
    rank, scale = _scale(meta, meta_file)
    tensors = _load_safetensors(weights_file)
    found: dict[tuple[int, str, str], np.ndarray] = {}
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ModelFormatError(f"{weights_file}: tensor {key!r} is not a lora_A/lora_B "
                                   "weight of a decoder layer")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise ModelFormatError(f"{weights_file}: tensor {key!r} targets {module!r}, "
                                   f"not in target_modules {list(targets)}")
        if layer >= cfg.num_layers:
            raise ModelFormatError(f"{weights_file}: tensor {key!r} names layer {layer}; "
                                   f"the model has {cfg.num_layers}")
        out_dim, in_dim = module_shape(cfg, module)
        want = (rank, in_dim) if ab == "A" else (out_dim, rank)
        if tuple(arr.shape) != want:
            raise ModelFormatError(f"{weights_file}: tensor {key!r} has shape "
                                   f"{tuple(arr.shape)}, expected {want} (r={rank})")
        found[(layer, module, ab)] = arr
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    for i in range(cfg.num_layers):
        pairs = {}
        for module in targets:
            a, b = found.get((i, module, "A")), found.get((i, module, "B"))
            if a is None or b is None:
                raise ModelFormatError(f"{weights_file}: layer {i} {module} lacks its "
                                       f"lora_{'A' if a is None else 'B'} weight")
            if cfg.rope_style is RopeStyle.INTERLEAVED and module in ("q_proj", "k_proj"):
                b = _interleave_heads(b, cfg.num_heads if module == "q_proj"
                                      else cfg.num_kv_heads)
            pairs[module] = (np.ascontiguousarray(a, np.float32),
                             np.ascontiguousarray(b, np.float32))
        layers.append(pairs)
    return LoraAdapter(name, rank, scale, targets, tuple(layers))


def merge_adapter(weights: ModelWeights, adapter: LoraAdapter) -> ModelWeights:
    """A copy of `weights` with the adapter folded in (W + scale * B @ A): what a request
    with the adapter computes, as one plain model."""
    layers = []
    for i, lw in enumerate(weights.layers):
        changes = {}
        for module in adapter.targets:
            field = MODULES[module]
            delta = adapter.delta(i, module)
            assert delta is not None
            changes[field] = (getattr(lw, field) + delta).astype(np.float32)
        layers.append(replace(lw, **changes))
    return replace(weights, layers=layers)
