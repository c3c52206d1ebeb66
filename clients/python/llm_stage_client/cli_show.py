"""How `llm-stage generate` shows a generation: the text on stdout, every other sink port's
deltas as readable lines on stderr, and the final report as JSON with whole numbers (and the
text's log-probabilities, when asked, under "logprobs" and "prompt_logprobs").

The contract's diagnostics travel as a protobuf Struct, whose numbers are all doubles and whose
64-bit seeds are strings; the report printed here gives counts as integers and the seed as a
number again, so `jq .diagnostics.thinker.tokens_out` reads 40, not 40.0.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from llm_stage_client.controls import TokenLogprob
from llm_stage_client.types import Delta, FinalReport, StageClientError

# Ports whose deltas carry text; the first one that speaks is the text shown on stdout. (The
# orchestrator sends one delta per stage and step, under the first of its sinks the caller
# attached, so a stage's text never arrives twice.)
_TEXT_PORTS = ("text", "tokens")
_DIGITS = 6  # decimals of a log-probability printed (float32 carries about 7 digits)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class Display:
    """Writes each delta where it belongs (see the module docstring); one per generation."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        """`out`, `err`: where text and the other lines go (default: sys.stdout, sys.stderr
        as they are when the display is made)."""
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._shown: tuple[str, str] | None = None  # the (stage, port) whose text is on stdout
        self._totals: dict[tuple[str, str], int] = {}
        self.is_mid_line = False  # stdout holds text not yet ended by a newline
        self._logprobs: list[TokenLogprob] = []  # of the text on stdout, one per token
        self._prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def show(self, delta: Delta) -> None:
        key = (delta.stage_id, delta.port)
        if self._shown is None and delta.port in _TEXT_PORTS:
            self._shown = key
        if key == self._shown:
            self._logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs:
                self._prompt_logprobs = delta.prompt_logprobs
            if delta.text:
                self._out.write(delta.text)
                self._out.flush()
                self.is_mid_line = True
            return
        total = self._totals[key] = self._totals.get(key, 0) + len(delta.token_ids)
        print(f"[{delta.stage_id}:{delta.port}] {self._describe(delta, total)}", file=self._err,
              flush=True)

    @staticmethod
    def _describe(delta: Delta, total: int) -> str:
        n = len(delta.token_ids)
        if delta.port == "audio":  # one codec frame per thinker step
            codes = " ".join(str(c) for c in delta.token_ids[:8])
            more = " ..." if n > 8 else ""
            return f"+{_plural(n, 'frame')} ({total} so far): codes {codes}{more}"
        if delta.port == "hidden":
            return f"+{_plural(n, 'row')} ({total} so far)"
        shown = f" text {delta.text!r}" if delta.text else ""
        return f"+{_plural(n, 'token')} ({total} so far){shown}"

    def scores(self) -> dict[str, list[dict[str, Any]]]:
        """The log-probabilities of the text shown, as the report prints them: "logprobs"
        (one per generated token) and "prompt_logprobs", each only when it came."""
        out = {}
        if self._logprobs:
            out["logprobs"] = [lp.as_dict(_DIGITS) for lp in self._logprobs]
        if self._prompt_logprobs:
            out["prompt_logprobs"] = [lp.as_dict(_DIGITS) for lp in self._prompt_logprobs]
        return out

    def end_line(self) -> None:
        """Ends the text on stdout with a newline (before an error line, or at the end)."""
        if self.is_mid_line:
            self._out.write("\n")
            self._out.flush()
            self.is_mid_line = False


def stream(items: Iterator[Delta | FinalReport], display: Display) -> FinalReport | None:
    """Shows every delta as it comes; returns the final report (None if none came)."""
    report = None
    try:
        for item in items:
            if isinstance(item, FinalReport):
                report = item
            else:
                display.show(item)
    except StageClientError:
        display.end_line()
        raise
    return report


def _is_real(key: str) -> bool:
    """Keys whose values are measures or settings, not counts (kept as floats)."""
    return key in ("temperature", "top_p") or key.endswith(("_ms", "_s"))


def _plain(value: Any, key: str = "") -> Any:
    """Struct values as a person expects them: integral doubles as ints, the seed a number."""
    if isinstance(value, dict):
        return {k: _plain(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value.is_integer() and not _is_real(key):
        return int(value)
    if key == "seed" and isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def report_json(report: FinalReport, scores: dict[str, Any] | None = None) -> str:
    """The final report as one line of JSON, counts as integers; `scores` (Display.scores)
    joins it as they are."""
    return json.dumps({**_plain(dataclasses.asdict(report)), **(scores or {})})
