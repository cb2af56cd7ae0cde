"""What the classifiers' and embedders' batch managers share: request field checks, label names and
scores, a checkpoint's config, prepared requests (no I/O of their own but ``load_config``)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from ..errors import PayloadError
from .base import BatchManager


def check_int(data: Dict[str, Any], key: str, lo: int = 1) -> None:
    v = data.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
        raise PayloadError(f"{key}={v!r}: must be an int >= {lo}", key)


def labels_of(id2label: Optional[Dict[Any, str]], n: Optional[int]) -> List[str]:
    """The label names of a classifier head of ``n`` outputs (``n`` defaults to ``len(id2label)``)."""
    if n is None:
        n = len(id2label) if id2label else None
    if not n:
        raise ValueError("num_labels: give id2label or num_labels")
    id2label = {int(k): str(v) for k, v in (id2label or {}).items()}
    return [id2label.get(i, f"LABEL_{i}") for i in range(n)]


def scores_of(logits: torch.Tensor, problem_type: Optional[str]) -> torch.Tensor:
    if logits.shape[-1] == 1 or problem_type == "regression":
        return logits
    if problem_type == "multi_label_classification":
        return logits.sigmoid()
    return logits.softmax(-1)


def top_labels(logits: torch.Tensor, labels: List[str], k: int, problem_type: Optional[str]) -> Dict[str, Any]:
    """One classification answer: the ``k`` best labels with scores, best first, and the raw logits."""
    scores = scores_of(logits.float(), problem_type)
    k = max(1, min(int(k), scores.shape[-1]))
    vals, idx = torch.topk(scores, k)
    best = [{"label": labels[int(i)], "score": float(v)} for v, i in zip(vals.tolist(), idx.tolist())]
    return {"label": best[0]["label"], "score": best[0]["score"], "labels": best,
            "logits": [float(x) for x in logits.tolist()]}


def load_config(path: str):
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"checkpoint {path!r} has no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def prepared(manager: BatchManager, data: Any, kind: type) -> Any:
    """``data`` as ``manager.prepare`` makes it (requests reach ``make_batch`` prepared by the engine;
    this also takes raw ones, as a caller of ``make_batch`` may pass)."""
    return data if isinstance(data, kind) else manager.prepare(data)


__all__ = ["check_int", "labels_of", "scores_of", "top_labels", "load_config", "prepared"]
