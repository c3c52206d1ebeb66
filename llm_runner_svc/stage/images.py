"""Images of a request, from encoded bytes to embeddings at their placeholder positions.

On Admit's worker thread, for a stage whose model has a vision tower: each image's bytes are
hashed (the encoder cache's key); an image the cache lacks is decoded with Pillow (strictly:
its MIME type's format, complete, non-empty, not over maxImagePixels), preprocessed as the
model's preprocessor config says and run through the tower with the other missing images of
the request, then cached. Visual pruning (visual_pruning.py), when configured, keeps a subset
of each image's tokens. The prompt's placeholders (one image token per image, as the chat
template or the caller wrote it) are expanded to one per kept token, and each image's
embeddings become an `EmbedSpan` over its run, keyed for the prefix cache by the image's hash
and the tokens kept.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_runner_svc.engines.batch import EmbedSpan
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.image_processing import MIME_FORMATS, decode_image, preprocess
from llm_runner_svc.models.model import Model
from llm_runner_svc.runtime.encoder_cache import EncoderCache
from llm_runner_svc.stage.limits import RequestLimits
from llm_runner_svc.stage.request import StageRequest
from llm_runner_svc.stage.visual_pruning import PruningConfig, prune


@dataclass(frozen=True)
class MediaReport:
    """What the images of one request cost (Diagnostics)."""

    num_images: int = 0
    visual_tokens_before: int = 0  # the encoder's tokens, summed over the images
    visual_tokens_after: int = 0  # kept after pruning (= before without it)
    encoder_ms: float = 0.0  # decoding, preprocessing and the tower (0 when all cached)
    encoder_cache_hits: int = 0  # images whose embeddings came from the cache
    images_encoded: int = 0  # images run through the tower for this request

    def as_dict(self) -> dict[str, Any]:
        return {"images": self.num_images, "visual_tokens_before": self.visual_tokens_before,
                "visual_tokens_after": self.visual_tokens_after,
                "encoder_ms": round(self.encoder_ms, 3),
                "encoder_cache_hits": self.encoder_cache_hits,
                "images_encoded": self.images_encoded}


class AdmittedPrompt(tuple[int, ...]):
    """A prompt's token ids (a tuple, as Slot.admitted holds them) with its images'
    embeddings at their positions and what producing them cost."""

    embeds: tuple[EmbedSpan, ...]
    media: MediaReport

    def __new__(cls, ids: Sequence[int], embeds: tuple[EmbedSpan, ...] = (),
                media: MediaReport | None = None) -> AdmittedPrompt:
        obj = super().__new__(cls, ids)
        obj.embeds = embeds
        obj.media = media or MediaReport()
        return obj


class MediaRefused(Exception):
    """The request's images cannot be served; admission turns it into a refusal."""


def content_key(mime_type: str, data: bytes) -> bytes:
    return hashlib.blake2b(mime_type.encode() + b"\0" + data, digest_size=16).digest()


class ImageEncoder:
    """The stage's images path: the model's tower (an engine's `create_vision`), the
    encoder cache (None: off) and the pruning settings (None: off)."""

    def __init__(self, model: Model, tower: Any, limits: RequestLimits,
                 cache: EncoderCache | None = None, pruning: PruningConfig | None = None
                 ) -> None:
        assert model.vision is not None
        self.model = model
        self.vision = model.vision
        self.tower = tower
        self.limits = limits
        self.cache = cache
        self.pruning = pruning
        self.num_encoded = 0  # images run through the tower since start

    @staticmethod
    def check_types(req: StageRequest) -> None:
        """The cheap check, before any bytes are read: every item's MIME type."""
        for i, m in enumerate(req.media):
            if m.mime_type not in MIME_FORMATS:
                raise MediaRefused(f"media[{i}]: MIME type {m.mime_type!r} is not one this stage "
                              f"decodes ({', '.join(MIME_FORMATS)})")

    def admit(self, req: StageRequest, prompt_ids: Sequence[int]) -> AdmittedPrompt:
        """The prompt with its images placed; MediaRefused when they cannot be."""
        vc = self.vision.config
        placed = [i for i, t in enumerate(prompt_ids) if t == vc.image_token_id]
        order = req.image_order()
        if len(placed) != len(order):
            raise MediaRefused(f"the prompt places {len(placed)} image(s) "
                               f"({self.vision.image_token}), the request carries {len(order)}")
        if not order:
            return AdmittedPrompt(prompt_ids)
        t0 = time.perf_counter()
        keys = [content_key(req.media[i].mime_type, req.media[i].data) for i in order]
        feats: list[Any] = [self.cache.get(k) if self.cache is not None else None
                            for k in keys]
        hits = sum(f is not None for f in feats)
        missing = [j for j, f in enumerate(feats) if f is None]
        pixels = {}
        for j in missing:
            if keys[j] in pixels:
                continue
            m = req.media[order[j]]
            try:
                img = decode_image(m.data, m.mime_type, self.limits.max_image_pixels)
            except InvalidArgument as exc:
                raise MediaRefused(f"media[{order[j]}]: {exc.message}") from exc
            pixels[keys[j]] = preprocess(img, self.vision.preprocess, vc.image_size)
        if pixels:
            out = self.tower.encode(np.stack(list(pixels.values())))
            encoded = dict(zip(pixels, out, strict=True))
            self.num_encoded += len(encoded)
            for k, f in encoded.items():
                if self.cache is not None:
                    self.cache.put(k, f)
            feats = [encoded.get(k, f) for k, f in zip(keys, feats, strict=True)]
        encoder_ms = (time.perf_counter() - t0) * 1000.0 if pixels else 0.0
        return self._place(prompt_ids, placed, keys, feats, MediaReport(
            len(order), sum(len(f) for f in feats), 0, encoder_ms, hits, len(pixels)))

    def _place(self, prompt_ids: Sequence[int], placed: list[int], keys: list[bytes],
               feats: list[Any], report: MediaReport) -> AdmittedPrompt:
        """Each placeholder expanded to its image's kept tokens, the spans over them."""
        vc = self.vision.config
        kept: list[Any] = feats
        span_keys = keys
        if self.pruning is not None:
            text = [t for t in prompt_ids if t != vc.image_token_id]
            text_emb = self.model.weights.embedding[np.asarray(text, dtype=np.int64)]
            picks = [prune(f, text_emb, self.pruning) for f in feats]
            kept = [f[p] for f, p in zip(feats, picks, strict=True)]
            span_keys = [hashlib.blake2b(k + np.asarray(p, np.int32).tobytes(),
                                         digest_size=16).digest()
                         for k, p in zip(keys, picks, strict=True)]
        ids: list[int] = []
        spans: list[EmbedSpan] = []
        last = 0
        opening, closing = self.vision.wrap
        for j, pos in enumerate(placed):
            ids += [*prompt_ids[last:pos], *opening]
            spans.append(EmbedSpan(len(ids), kept[j], span_keys[j]))
            ids += [vc.image_token_id] * len(kept[j]) + list(closing)
            last = pos + 1
        ids += prompt_ids[last:]
        after = sum(len(f) for f in kept)
        return AdmittedPrompt(ids, tuple(spans), MediaReport(
            report.num_images, report.visual_tokens_before, after, report.encoder_ms,
            report.encoder_cache_hits, report.images_encoded))
