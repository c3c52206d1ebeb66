"""Images as a vision tower takes them: decoded with Pillow, then resized, cropped, rescaled
and normalised as the model's preprocessor config (preprocessor_config.json) says.

Two resize rules, as transformers' image processors apply them: `size.shortest_edge` (CLIP:
the short side to that length, aspect kept, then a centre crop to `crop_size`) or
`size.height` / `size.width` (SigLIP: straight to that size); Idefics3's `longest_edge`
sizes are served as one square image at the tower's size (no splitting into tiles).
Decoding is strict: the bytes must be the format their MIME type names, decode completely
and hold at least one pixel.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from llm_runner_svc.errors import InvalidArgument

MIME_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG"}


def decode_image(data: bytes, mime_type: str, max_pixels: int) -> Image.Image:
    """The RGB image in `data`; InvalidArgument saying why when it is not one."""
    fmt = MIME_FORMATS.get(mime_type)
    if fmt is None:
        raise InvalidArgument(f"MIME type {mime_type!r} is not an image type this stage "
                              f"decodes ({', '.join(MIME_FORMATS)})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])
            width, height = img.size
            if width * height == 0:
                raise InvalidArgument(f"the {mime_type} image is {width}x{height}: empty")
            if width * height > max_pixels:
                raise InvalidArgument(f"the {mime_type} image is {width}x{height}, more than "
                                      f"{max_pixels} pixels (maxImagePixels)")
            img.load()  # a truncated or corrupt stream fails here, before any work
    except InvalidArgument:
        raise
    except Exception as exc:  # a decoder fed hostile bytes may raise anything (struct, zlib)
        raise InvalidArgument(f"the bytes do not decode as {mime_type} ({exc})") from exc
    return img.convert("RGB")


def _resample(cfg: Mapping[str, Any]) -> Image.Resampling:
    return Image.Resampling(int(cfg.get("resample", Image.Resampling.BICUBIC)))


def preprocess(img: Image.Image, cfg: Mapping[str, Any], image_size: int) -> np.ndarray:
    """[3, H, W] float32 pixel values of `img` under preprocessor config `cfg` (the tower's
    `image_size` where the config says nothing)."""
    size = cfg.get("size") or {"height": image_size, "width": image_size}
    if cfg.get("do_resize", True):
        if "shortest_edge" in size:
            edge = int(size["shortest_edge"])
            w, h = img.size
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(edge * long / short)
            target = (edge, new_long) if w <= h else (new_long, edge)
            img = img.resize(target, _resample(cfg))
        elif "height" in size and "width" in size:
            img = img.resize((int(size["width"]), int(size["height"])), _resample(cfg))
        else:  # longest_edge (Idefics3): one tile, square at the tower's size, not split
            img = img.resize((image_size, image_size), _resample(cfg))
    if cfg.get("do_center_crop", False):
        crop = cfg.get("crop_size") or {"height": image_size, "width": image_size}
        ch, cw = int(crop["height"]), int(crop["width"])
        w, h = img.size
        left, top = (w - cw) // 2, (h - ch) // 2
        img = img.crop((left, top, left + cw, top + ch))
    x = np.asarray(img, dtype=np.float32)  # [H, W, 3]
    if cfg.get("do_rescale", True):
        x = x * np.float32(cfg.get("rescale_factor", 1 / 255))
    if cfg.get("do_normalize", True):
        mean = np.asarray(cfg.get("image_mean", [0.5] * 3), np.float32)
        std = np.asarray(cfg.get("image_std", [0.5] * 3), np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1))
