"""Small real LoRA adapters in the PEFT format, written with numpy + safetensors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from llm_runner_svc.models.lora import module_shape
from llm_runner_svc.models.spec import ModelConfig

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, cfg: ModelConfig, seed: int, rank: int = 4, alpha: float = 8.0,
                  targets: Sequence[str] = ALL_MODULES, std: float = 0.2,
                  rslora: bool = False) -> Path:
    """An adapter directory as PEFT saves one, with random A and non-zero random B (PEFT
    starts B at zero; a trained adapter does not) large enough to change greedy tokens."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in targets:
            out_dim, in_dim = module_shape(cfg, m)
            part = "self_attn" if m in ALL_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, in_dim)) * std
                                               ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_dim, rank)) * std
                                               ).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
            "target_modules": list(targets), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(meta))
    return path
