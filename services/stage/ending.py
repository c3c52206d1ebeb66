"""Why a request's run ended: the contract's FinishReason, as every stage and runtime sees it."""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    END_OF_SEQUENCE = "end_of_sequence"
    MAX_LENGTH = "max_length"
    STOP_WORDS = "stop_words"
    CANCELLED = "cancelled"
    ERROR = "error"
