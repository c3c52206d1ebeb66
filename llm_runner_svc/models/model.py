"""A loaded model: the type every loader returns."""

from __future__ import annotations

from dataclasses import dataclass

from llm_runner_svc.models.chat import ChatTemplate
from llm_runner_svc.models.spec import ModelConfig, ModelWeights
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.models.vision import VisionModel


@dataclass
class Model:
    """A loaded model: what it is, its host weights, its tokenizer and chat template."""

    name: str
    format: str
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None = None
    vision: VisionModel | None = None  # a vision-language model's tower (images in)
