"""Images through the Stage service (a tiny random LLaVA with a CLIP tower): greedy tokens
equal transformers' for a PNG in a text prompt and for two images in a chat, the encoder
cache serves a repeated image without running the encoder, and bad media is refused with a
reason, leaving the stage idle."""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from google.protobuf.json_format import MessageToDict  # noqa: E402
from helpers import TEST_ENGINE  # noqa: E402
from PIL import Image  # noqa: E402
from stage_harness import StageServer, make_request  # noqa: E402
from vlm_fixtures import IMAGE_TOKEN_ID, build_idefics3, build_llava  # noqa: E402

from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.stage import MediaItem, StageConfig, StageRequest  # noqa: E402
from llm_runner_svc.stage.visual_pruning import PruningConfig  # noqa: E402
from services.contract.llmstage.v1 import stage_pb2 as pb  # noqa: E402

TOKENS = 8


def png(seed: int, size: tuple[int, int] = (24, 20)) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def empty_png() -> bytes:
    """A PNG whose header says 0x0 (Pillow will not write one)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


# The graph engines take token ids only (test_an_engine_without_embeddings_refuses_the_model):
# where the suite runs on one of them, these stages stay on numpy.
ON_NUMPY = TEST_ENGINE not in ("numpy", "torch")


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("vlm") / "llava"
    return path, build_llava(path, "clip", "llama", seed=3)


@pytest.fixture(scope="module")
def server(llava: tuple[Path, Any]) -> Iterator[StageServer]:
    cfg = StageConfig(artifact=str(llava[0]), max_batch=4, max_seq=256, prefix_cache=True,
                      encoder_cache_bytes=1 << 20)
    with StageServer(cfg, keep_engine=ON_NUMPY) as srv:
        yield srv


def _pixels(path: Path, images: list[bytes]) -> torch.Tensor:
    """The images as transformers' own (PIL) CLIP processor prepares them."""
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    proc = transformers.CLIPImageProcessorPil(**cfg)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return torch.from_numpy(proc(images=pil, return_tensors="np")["pixel_values"])


def _reference(tm: Any, ids: list[int], pixels: torch.Tensor) -> list[int]:
    out: list[int] = []
    for _ in range(TOKENS):
        with torch.no_grad():
            logits = tm(input_ids=torch.tensor([ids + out]), pixel_values=pixels).logits
        out.append(int(logits[0, -1].argmax()))
    return out


def _run(srv: StageServer, sid: int, request: pb.GenerationRequest
         ) -> tuple[list[int], dict[str, Any]]:
    ans = srv.stub.Admit(pb.AdmitRequest(slot_id=sid, request=request))
    assert ans.admitted, ans.reason
    srv.stub.Prepare(pb.PrepareRequest(slot_id=sid))
    stream = srv.step([sid])
    got = stream.collect({sid})[sid]
    srv.stub.Finish(pb.FinishRequest(slot_id=sid))
    diag = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)).values)
    srv.stub.Reset(pb.ResetRequest(slot_id=sid))
    stream.half_close()
    return got["tokens"], diag


def _media(*images: bytes) -> list[pb.MediaPart]:
    return [pb.MediaPart(mime_type="image/png", data=b) for b in images]


def test_text_prompt_with_an_image_matches_transformers(server: StageServer,
                                                        llava: tuple[Path, Any]) -> None:
    path, tm = llava
    image = png(1)
    req = make_request(text="<image> Describe the image.", temperature=0.0,
                       max_tokens=TOKENS, ignore_eos=True, media=_media(image))
    tokens, diag = _run(server, 1, req)
    tok = server.stage.model.tokenizer
    ids = [0] + [IMAGE_TOKEN_ID] * 16 + tok.encode(" Describe the image.", add_bos=False)
    assert tokens == _reference(tm, ids, _pixels(path, [image]))
    assert diag["tokens_in"] == len(ids)
    assert diag["media"]["images"] == 1 and diag["media"]["images_encoded"] == 1
    assert diag["media"]["visual_tokens_before"] == diag["media"]["visual_tokens_after"] == 16
    assert diag["media"]["encoder_cache_hits"] == 0 and diag["media"]["encoder_ms"] > 0

    # the same image again: no encoder run, the same tokens, the image's pages reused
    again, diag2 = _run(server, 2, req)
    assert again == tokens
    assert diag2["media"]["encoder_cache_hits"] == 1 and diag2["media"]["images_encoded"] == 0
    assert diag2["media"]["encoder_ms"] == 0 and diag2["cached_tokens"] > 0
    # another image at the same placeholders reuses no page that holds image positions
    other, diag3 = _run(server, 3, make_request(
        text="<image> Describe the image.", temperature=0.0, max_tokens=TOKENS,
        ignore_eos=True, media=_media(png(2))))
    assert diag3["cached_tokens"] == 0
    assert other == _reference(tm, ids, _pixels(path, [png(2)]))
    stats = server.wait_idle()
    assert stats["encoder_cache_entries"] == 2 and stats["encoder_cache_hits"] >= 1
    gauge = server.stage.metrics.registry.get_sample_value
    assert gauge("llmstage_encoder_cache_hits") == stats["encoder_cache_hits"]
    assert gauge("llmstage_images_encoded") == stats["images_encoded"]


def test_chat_with_two_images_in_the_order_the_parts_place_them(
        server: StageServer, llava: tuple[Path, Any]) -> None:
    path, tm = llava
    first, second = png(5, (30, 18)), png(6, (16, 40))
    req = pb.GenerationRequest(media=_media(first, second), ignore_eos=True,
                               sampling=pb.SamplingOverrides(temperature=0.0,
                                                             max_tokens=TOKENS))
    req.messages.messages.append(pb.ChatMessage(role="user", parts=[
        pb.ChatPart(text="Compare "), pb.ChatPart(image=1), pb.ChatPart(text=" and "),
        pb.ChatPart(image=0), pb.ChatPart(text=".")]))
    tokens, diag = _run(server, 4, req)
    tok = server.stage.model.tokenizer
    text = server.stage.model.chat_template.render([{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "image"}, {"type": "text", "text": "."}]}])
    assert text.count("<image>") == 2
    ids = [i for t in tok.encode(text, add_bos=False)
           for i in ([t] * 16 if t == IMAGE_TOKEN_ID else [t])]
    assert diag["tokens_in"] == len(ids) and diag["media"]["images"] == 2
    assert tokens == _reference(tm, ids, _pixels(path, [second, first]))


BAD = [
    ("truncated", dict(text="<image> Hi", media=[pb.MediaPart(
        mime_type="image/png", data=png(7)[:60])]), "do not decode as image/png"),
    ("empty", dict(text="<image> Hi", media=[pb.MediaPart(
        mime_type="image/png", data=empty_png())]), "image/png"),
    ("mime_gif", dict(text="<image> Hi", media=[pb.MediaPart(
        mime_type="image/gif", data=png(7))]), "'image/gif'"),
    ("png_as_jpeg", dict(text="<image> Hi", media=[pb.MediaPart(
        mime_type="image/jpeg", data=png(7))]), "do not decode as image/jpeg"),
    ("nine_megabytes", dict(text="<image> Hi", media=[pb.MediaPart(
        mime_type="image/png", data=b"\0" * (9 << 20))]), "maxMediaBytes"),
    ("two_for_one", dict(text="<image> Hi", media=_media(png(1), png(2))),
     "places 1 image(s)"),
    ("none_placed", dict(text="Hi", media=_media(png(1))), "places 0 image(s)"),
]


@pytest.mark.parametrize("name,kw,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_media_is_refused_with_a_reason(server: StageServer, name: str, kw: dict,
                                            needle: str) -> None:
    before = server.wait_idle()
    ans = server.admit(9, **kw)
    assert not ans.admitted and ans.refusal == pb.REFUSAL_MEDIA_INVALID
    assert needle in ans.reason, ans.reason
    after = server.wait_idle()
    assert after["slots"] == 0 and after["kv_pages_free"] == after["kv_pages_total"]
    assert after["images_encoded"] == before["images_encoded"]


def test_a_hundred_megabyte_image_is_refused_before_decoding(server: StageServer) -> None:
    """Larger than a gRPC message may be; the stage's own check refuses it all the same."""
    req = StageRequest("big", text="<image> Hi",
                       media=(MediaItem("image/png", b"\x89PNG" + b"\0" * (100 << 20)),))
    adm = server.run(server.stage.admit(11, req))
    assert not adm.is_admitted and "maxMediaBytes" in adm.reason
    assert server.wait_idle()["slots"] == 0


def test_budget_and_pruning_on_a_stream_of_distinct_images(llava: tuple[Path, Any]) -> None:
    """Each image's embeddings take 16 x 64 float32 = 4,096 bytes; the budget holds two.
    Pruning at ratio 0.5 keeps 8 of each image's 16 tokens."""
    cfg = StageConfig(artifact=str(llava[0]), max_batch=2, max_seq=256,
                      encoder_cache_bytes=10_000,
                      visual_pruning=PruningConfig(0.5, 1, 2, 2))
    with StageServer(cfg, keep_engine=ON_NUMPY) as srv:
        for i in range(6):
            tokens, diag = _run(srv, 20 + i, make_request(
                text="<image> What is it?", temperature=0.0, max_tokens=2,
                media=_media(png(100 + i))))
            assert len(tokens) == 2
            assert diag["media"]["visual_tokens_before"] == 16
            assert diag["media"]["visual_tokens_after"] == 8
            stats = srv.wait_idle()
            assert stats["encoder_cache_bytes"] <= 10_000
        assert stats["encoder_cache_entries"] == 2 and stats["encoder_cache_evictions"] == 4
        assert stats["images_encoded"] == 6


def test_idefics3_wraps_each_image_as_its_processor_does(tmp_path: Path) -> None:
    """An Idefics3 stage: each image's 4 tokens (16 patches, pixel shuffle 2) sit between
    <fake_token_around_image><global-img> and <fake_token_around_image>; greedy tokens as
    transformers' for a square PNG (resized as its processor does without tiles)."""
    tm = build_idefics3(tmp_path / "idefics3", seed=2)
    image = png(12, (32, 32))
    cfg = StageConfig(artifact=str(tmp_path / "idefics3"), max_batch=2, max_seq=128)
    with StageServer(cfg, keep_engine=ON_NUMPY) as srv:
        tokens, diag = _run(srv, 1, make_request(text="<image> Hi", temperature=0.0,
                                                 max_tokens=TOKENS, ignore_eos=True,
                                                 media=_media(image)))
        tok = srv.stage.model.tokenizer
    ids = [0, 3, 4, *[IMAGE_TOKEN_ID] * 4, 3, *tok.encode(" Hi", add_bos=False)]
    assert diag["tokens_in"] == len(ids) and diag["media"]["visual_tokens_after"] == 4
    cfg_pre = json.loads((tmp_path / "idefics3" / "preprocessor_config.json").read_text())
    pixels = transformers.Idefics3ImageProcessorPil(**cfg_pre)(
        images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt")[
        "pixel_values"]
    out: list[int] = []
    for _ in range(TOKENS):
        with torch.no_grad():
            logits = tm(input_ids=torch.tensor([ids + out]), pixel_values=pixels).logits
        out.append(int(logits[0, -1].argmax()))
    assert tokens == out


def test_an_engine_without_embeddings_refuses_the_model(llava: tuple[Path, Any]) -> None:
    """A vision-language model on an engine that takes token ids only (the graph engines)
    stops at load, and such an engine refuses a row with embeddings."""
    pytest.importorskip("onnxruntime")
    from llm_runner_svc.engines.base import EnginePlan, check_batch
    from llm_runner_svc.engines.batch import Batch, EmbedSpan, Row
    from llm_runner_svc.errors import InvalidArgument, Unimplemented
    from llm_runner_svc.stage import LlmStage

    cfg = StageConfig(artifact=str(llava[0]), engine="onnx", max_batch=1, max_seq=64)
    with pytest.raises(Unimplemented, match="'onnx' engine takes token ids only"):
        LlmStage.create(cfg)
    model = load_model(llava[0])
    plan = EnginePlan(max_batch=1, max_seq=64, page_size=16, num_pages=4)
    row = Row((0, 2, 2), 0, [0], embeds=(EmbedSpan(1, np.zeros((2, 64), np.float32)),))
    with pytest.raises(InvalidArgument, match="takes token ids only"):
        check_batch(model.config, plan, Batch((row,)), supports_embeds=False)
    check_batch(model.config, plan, Batch((row,)))
