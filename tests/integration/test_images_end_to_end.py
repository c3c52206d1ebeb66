"""Images through a whole deployment (a tiny random LLaVA stage process behind the
orchestrator and the HTTP gateway): the Python client's `images=[...]`, `llm-stage generate
--image FILE` and an OpenAI chat body with an image_url data: URL give transformers' greedy
tokens; a repeated image is served from the encoder cache; bad media is a clear error."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deployment import Deployment  # noqa: E402
from http_gateway import LONG, GatewayProc, llm_stage_generate, request  # noqa: E402
from llm_stage_client import Client, StageClientError  # noqa: E402
from PIL import Image  # noqa: E402
from vlm_fixtures import IMAGE_TOKEN_ID, build_llava  # noqa: E402

from llm_runner_svc.models import load_model  # noqa: E402

TOKENS = 6
QUESTION = "What is in the picture?"


def _png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[Deployment, GatewayProc, Path, Any]]:
    tmp = tmp_path_factory.mktemp("vlm")
    tm = build_llava(tmp / "llava", "clip", "llama", seed=8)
    dep = Deployment(tmp, {"vlm": {"artifact": str(tmp / "llava"), "maxSeq": 256, "config": {
        "context_cache": {"encoder_cache_budget_bytes": 1 << 20}}}})
    gw = GatewayProc(dep.target)
    yield dep, gw, tmp / "llava", tm
    gw.stop()
    dep.close()


def _reference(path: Path, tm: Any, image: bytes) -> tuple[list[int], str]:
    """Greedy tokens and text of transformers for the chat [image, QUESTION]."""
    model = load_model(path)
    text = model.chat_template.render([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": QUESTION}]}])
    ids = [i for t in model.tokenizer.encode(text, add_bos=False)
           for i in ([t] * 16 if t == IMAGE_TOKEN_ID else [t])]
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    pixels = transformers.CLIPImageProcessorPil(**cfg)(
        images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")[
        "pixel_values"]
    out: list[int] = []
    for _ in range(TOKENS):
        with torch.no_grad():
            logits = tm(input_ids=torch.tensor([ids + out]), pixel_values=pixels).logits
        out.append(int(logits[0, -1].argmax()))
    return out, model.tokenizer.decode(out)


def test_client_cli_and_gateway_pass_images_through(
        vlm: tuple[Deployment, GatewayProc, Path, Any], tmp_path: Path) -> None:
    dep, gw, path, tm = vlm
    image = _png(1)
    want_tokens, want_text = _reference(path, tm, image)
    with Client(dep.target, timeout=LONG) as client:
        items = list(client.generate(messages=[("user", [0, QUESTION])], images=[image],
                                     temperature=0, max_tokens=TOKENS, ignore_eos=True))
        tokens = [t for d in items[:-1] for t in d.token_ids]
        report = items[-1]
        assert tokens == want_tokens
        media = report.diagnostics["vlm"]["media"]
        assert media["images"] == 1 and media["images_encoded"] == 1
        again, report2 = client.generate_text(messages=[("user", [0, QUESTION])],
                                              images=[image], temperature=0,
                                              max_tokens=TOKENS, ignore_eos=True)
        assert again == want_text
        assert report2.diagnostics["vlm"]["media"]["encoder_cache_hits"] == 1
        with pytest.raises(StageClientError) as err:
            client.generate_text(messages=[("user", [0, QUESTION])],
                                 images=[image[:40]], max_tokens=2)
        assert err.value.code == "INVALID_ARGUMENT" and "REFUSAL_MEDIA_INVALID" in \
            err.value.message

    file = tmp_path / "picture.png"
    file.write_bytes(image)
    printed = llm_stage_generate(dep.target, QUESTION, "--image", str(file), "--temperature",
                                 "0", "--max-tokens", str(TOKENS))
    assert want_text.startswith(printed)  # the CLI stops at end-of-sequence

    url = "data:image/png;base64," + base64.b64encode(image).decode()
    status, _, body = request(f"{gw.url}/v1/chat/completions", {
        "model": "vlm", "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTION}]}]})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == want_text
    status, _, body = request(f"{gw.url}/v1/chat/completions", {
        "model": "vlm", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})
    assert status == 400 and "data:" in json.dumps(body)
    for stage in dep.all_stages:
        idle = stage.wait_idle()
        assert idle["slots"] == 0 and idle["kv_pages_free"] == idle["kv_pages_total"]
