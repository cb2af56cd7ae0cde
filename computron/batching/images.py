"""Batching for image classifiers (ViT): ``pixel_values`` or encoded ``image`` bytes in, top-k labels out.

A request carries ``pixel_values`` (``[C, H, W]`` or ``[1, C, H, W]``, a tensor
or nested lists, already preprocessed to the configured size) or ``image``:
encoded image bytes (PNG, JPEG, ... or their base64 text). ``prepare`` (at
submit, on a thread, outside the engine's lock) decodes the whole image with PIL
and preprocesses it with the checkpoint's image processor, so a truncated or
corrupt file fails its own request at once; ``make_batch`` only stacks. Answer:
``{"label", "score", "labels", "logits"}`` with the ``top_k`` (default 5) best labels.
"""
from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..errors import PayloadError
from .base import BatchManager, SubmitEntry, TaskEntry
from .common import check_int, labels_of, load_config, prepared, top_labels


@dataclass(frozen=True)
class PreparedImage:
    """An image request ready to batch: its pixels, preprocessed at submit, and its ``top_k``."""
    pixel_values: torch.Tensor
    top_k: int


class ImageClassificationBatchManager(BatchManager):
    """ViT-style image classification: ``pixel_values`` or encoded ``image`` bytes in, top-k labels out."""

    prepare_off_loop = True

    def __init__(self, id2label: Optional[Dict[int, str]] = None, num_labels: Optional[int] = None,
                 image_size: Any = 224, num_channels: int = 3, processor=None, max_batch_size: int = 8,
                 default_top_k: int = 5, problem_type: Optional[str] = None,
                 max_image_bytes: int = 32 << 20):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r}: must be an int >= 1")
        self.labels = labels_of(id2label, num_labels)
        h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.shape = (int(num_channels), int(h), int(w))
        self.processor = processor
        self.max_batch_size = max_batch_size
        self.default_top_k = default_top_k
        self.problem_type = problem_type
        self.max_image_bytes = max_image_bytes

    @classmethod
    def for_checkpoint(cls, path: str, max_batch_size: int = 8, **kw) -> "ImageClassificationBatchManager":
        """Labels and image size from ``config.json``; the image processor from ``preprocessor_config.json``
        (requests with ``image`` bytes need it; without one only ``pixel_values`` are taken)."""
        config = load_config(path)
        archs = config.architectures or []
        if not any(a.endswith("ForImageClassification") for a in archs):
            raise ValueError(f"checkpoint {path!r}: config.architectures={archs!r} has no image "
                             "classification head")
        processor = None
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            from transformers import AutoImageProcessor
            processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        return cls(id2label=config.id2label, num_labels=config.num_labels, image_size=config.image_size,
                   num_channels=config.num_channels, processor=processor, max_batch_size=max_batch_size,
                   problem_type=config.problem_type, **kw)

    # ---- checks at submit time -----------------------------------------------
    def _image_bytes(self, v: Any) -> bytes:
        if isinstance(v, str):
            if v.startswith("data:") and "," in v:
                v = v.split(",", 1)[1]
            try:
                v = base64.b64decode(v, validate=True)
            except ValueError:
                raise PayloadError("image: a string must be base64-encoded image bytes", "image") from None
        if not isinstance(v, (bytes, bytearray)):
            raise PayloadError(f"image must be bytes or base64 text, got {type(v).__name__}", "image")
        if not v:
            raise PayloadError("image is empty", "image")
        if len(v) > self.max_image_bytes:
            raise PayloadError(f"image has {len(v)} bytes; at most {self.max_image_bytes} are taken", "image")
        return bytes(v)

    def _pixels(self, v: Any) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            try:
                v = torch.tensor(v, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise PayloadError("pixel_values must be a tensor or nested lists of numbers", "pixel_values") from None
        if v.dim() == 4 and v.shape[0] == 1:
            v = v[0]
        if not (v.dtype.is_floating_point or v.dtype in (torch.uint8, torch.int64, torch.int32)):
            raise PayloadError(f"pixel_values must hold numbers, got {v.dtype}", "pixel_values")
        if tuple(v.shape) != self.shape:
            raise PayloadError(f"pixel_values has shape {tuple(v.shape)}; the model takes {self.shape} "
                               "(channels, height, width)", "pixel_values")
        v = v.float()
        if not torch.isfinite(v).all():
            raise PayloadError("pixel_values has NaN or infinite values", "pixel_values")
        return v

    def validate(self, data: Any) -> None:
        self.prepare(data)

    def prepare(self, data: Any) -> PreparedImage:
        if not isinstance(data, dict):
            raise TypeError(f"an image request is a dict with 'pixel_values' or 'image', got {type(data).__name__}")
        unknown = set(data) - {"pixel_values", "image", "top_k"}
        if unknown:
            raise PayloadError(f"unknown request fields {sorted(unknown)}", sorted(unknown)[0])
        if ("pixel_values" in data) == ("image" in data):
            raise PayloadError("exactly one of 'pixel_values' and 'image' is required")
        check_int(data, "top_k")
        top_k = int(data.get("top_k", self.default_top_k))
        if "pixel_values" in data:
            return PreparedImage(self._pixels(data["pixel_values"]), top_k)
        if self.processor is None:
            raise PayloadError("image: this model's checkpoint has no image processor; send pixel_values", "image")
        return PreparedImage(self._preprocess(self._decode(self._image_bytes(data["image"]))), top_k)

    @staticmethod
    def _decode(raw: bytes):
        """The whole image decoded (a truncated or corrupt file fails here, at submit time, not in a batch)."""
        from PIL import Image
        try:
            img = Image.open(io.BytesIO(raw))
            img.load()
        except Exception as exc:  # noqa: BLE001 - OSError, SyntaxError, DecompressionBombError, ... by format
            raise PayloadError(f"image: the bytes are no image PIL can read ({type(exc).__name__}: {exc})",
                               "image") from None
        return img

    def _preprocess(self, img) -> torch.Tensor:
        img = img.convert("RGB" if self.shape[0] == 3 else "L")
        pv = self.processor(images=[img], return_tensors="pt")["pixel_values"][0]
        if tuple(pv.shape) != self.shape:
            raise ValueError(f"image processor made shape {tuple(pv.shape)}; the model takes {self.shape}")
        return pv.float()

    # ---- batching ------------------------------------------------------------
    def make_batch(self, q: Deque[SubmitEntry]) -> Tuple[TaskEntry, dict]:
        head = q.popleft()
        taken = [(head, prepared(self, head.data, PreparedImage))]
        while q and len(taken) < self.max_batch_size:
            try:
                item = prepared(self, q[0].data, PreparedImage)
            except Exception:  # noqa: BLE001 - an image that does not decode fails alone, as the next head
                break
            taken.append((q.popleft(), item))
        batch = {"pixel_values": torch.stack([r.pixel_values for _, r in taken])}
        return TaskEntry(tuple(e.uid for e, _ in taken), batch), {"top_k": [r.top_k for _, r in taken]}

    def split_batch(self, task_entry: TaskEntry, top_k: Sequence[int] = (), **_) -> List[Tuple[Hashable, Any]]:
        logits = task_entry.batch["logits"]
        return [(uid, top_labels(logits[i], self.labels, top_k[i] if top_k else self.default_top_k,
                             self.problem_type))
                for i, uid in enumerate(task_entry.uids)]


__all__ = ["PreparedImage", "ImageClassificationBatchManager"]
