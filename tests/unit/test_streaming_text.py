"""Stop strings over streamed text, and the incremental detokenizer."""

from __future__ import annotations

from llm_runner_svc.models.tokenizer import StreamDecoder
from llm_runner_svc.runtime.stops import StopMatcher


def test_stop_string_split_across_deltas_is_held_back_then_cut():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d> tail") == ("", True)


def test_partial_match_that_fails_is_released():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ay") == ("STay", False)
    assert m.flush() == ""


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["b", "xyz"])
    assert m.feed("axyzb") == ("a", True)


def test_flush_returns_held_text():
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False)
    assert m.flush() == "ab"


def test_stream_decoder_never_splits_a_character(stories):
    tok = stories.tokenizer
    text = "Lily saw a café — naïve 🙂 bird."
    ids = tok.encode(text)[1:]
    dec = StreamDecoder(tok, after_bos=True)
    pieces = [dec.push([t]) for t in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert dec.text == text
