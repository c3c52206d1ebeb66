"""Stop strings over streamed text: emit what cannot be the start of a stop string, hold back
the rest until it is decided."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._pending = ""  # text received but not yet emitted

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add `delta`; return (text safe to emit, whether a stop string was met).

        On a match the emitted text ends just before the stop string."""
        if not self._stops:
            return delta, False
        text = self._pending + delta
        hit = -1
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            self._pending = ""
            return text[:hit], True
        hold = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason."""
        out, self._pending = self._pending, ""
        return out
