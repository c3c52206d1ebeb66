"""Image decoding is strict and never raises anything but InvalidArgument; preprocessing
follows the preprocessor config's resize rule."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.image_processing import decode_image, preprocess


def _encoded(fmt: str, size: tuple[int, int] = (30, 20)) -> bytes:
    rgb = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt)
    return buf.getvalue()


def test_png_and_jpeg_decode_to_rgb() -> None:
    for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        img = decode_image(_encoded(fmt), mime, 10_000)
        assert img.mode == "RGB" and img.size == (30, 20)


@pytest.mark.parametrize("data,mime,needle", [
    (_encoded("PNG"), "image/gif", "not an image type"),
    (_encoded("PNG"), "image/jpeg", "do not decode as image/jpeg"),
    (_encoded("JPEG"), "image/png", "do not decode as image/png"),
    (_encoded("PNG")[:50], "image/png", "do not decode"),
    (_encoded("JPEG")[:200], "image/jpeg", "do not decode"),
    (_encoded("PNG", (200, 200)), "image/png", "maxImagePixels"),
])
def test_bad_images_are_invalid_with_a_reason(data: bytes, mime: str, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        decode_image(data, mime, 10_000)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.sampled_from(["image/png", "image/jpeg"]))
def test_any_bytes_decode_or_are_invalid(data: bytes, mime: str) -> None:
    """Whatever the bytes: an RGB image with pixels, or InvalidArgument (nothing else)."""
    blob = b"\x89PNG\r\n\x1a\n" + data if mime == "image/png" else data
    try:
        img = decode_image(blob, mime, 1 << 20)
    except InvalidArgument as exc:
        assert mime in exc.message
        return
    assert img.mode == "RGB" and img.size[0] * img.size[1] > 0


def test_resize_rules() -> None:
    img = Image.fromarray(np.full((20, 40, 3), 255, np.uint8))
    clip = {"size": {"shortest_edge": 16}, "do_center_crop": True,
            "crop_size": {"height": 16, "width": 16}, "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3}
    siglip = {"size": {"height": 12, "width": 10}, "image_mean": [0.5] * 3,
              "image_std": [0.5] * 3}
    assert preprocess(img, clip, 16).shape == (3, 16, 16)
    out = preprocess(img, siglip, 16)
    assert out.shape == (3, 12, 10)
    np.testing.assert_allclose(out, 1.0)  # white, rescaled to 1, normalised by 0.5 / 0.5
    assert preprocess(img, {"size": {"longest_edge": 64}}, 14).shape == (3, 14, 14)
