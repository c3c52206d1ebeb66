"""The LlmRunner stage: admission, tokenization and the hidden port over the stage kit
(`services/stage/`), which owns slots, cohorts and the step loop.

No grpc here: the servicer translates the contract into calls on `LlmStage`.
"""

from llm_runner_svc.stage.config import StageConfig, load_stage_config
from llm_runner_svc.stage.llm_stage import LlmStage
from llm_runner_svc.stage.request import ChatPart, ChatTurn, MediaItem, StageRequest
from services.stage.slot import SlotState

__all__ = ["ChatPart", "ChatTurn", "LlmStage", "MediaItem", "SlotState", "StageConfig",
           "StageRequest", "load_stage_config"]
