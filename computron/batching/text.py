"""Batching for language understanding models: classifiers and embeddings (images: ``images.py``).

Every request is a plain dict and every answer a JSON-able dict, so an HTTP
front can pass ``await engine.submit(model_id, data)`` straight through.

Text requests (``TextClassificationBatchManager``, ``EmbeddingBatchManager``)
carry ``input_ids`` (a list of ints or a 1-D integer tensor) with optional
``attention_mask`` and ``token_type_ids`` of the same length, or, where the
checkpoint has a tokenizer, ``text`` (and optionally ``text_pair``), which is
tokenized with it and truncated to the model's positions. Requests are
right-padded with the pad id to the longest in the batch; the attention mask
hides the padding, so each answer equals the one the request would get alone.

- sequence classification: ``{"label", "score", "labels": [{"label", "score"}, ...], "logits"}``, the
  ``top_k`` best labels (request field, default 1) with softmax scores (sigmoid for multi-label models,
  the raw value for regression);
- token classification: ``{"labels": [...], "scores": [...], "logits": [[...]]}`` per token, plus
  ``"tokens"`` when the request was text;
- embeddings: ``{"embedding": [...], "pooling": "mean"|"cls", "tokens": n}``; ``mean`` (the default) averages the
  last hidden states over the tokens the attention mask keeps, ``cls`` takes the first token's;
  ``"normalize": true`` in a request scales its vector to unit length.

``prepare`` (run by the engine at submit time, on a thread of its own and
outside the engine's lock) validates a request, raising ``PayloadError`` whose
``param`` names the bad field, and tokenizes it; ``make_batch`` only pads.
Images (``images.py``) are decoded and preprocessed there too, so a truncated
or corrupt file fails its own request at once, not a batch.

``for_checkpoint(path)`` builds each manager from a checkpoint directory's
``config.json``, tokenizer files and ``preprocessor_config.json``, local files only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..comm.validation import POOLINGS, int_list
from ..errors import PayloadError
from ..loading import has_tokenizer
from .base import BatchManager, SubmitEntry, TaskEntry
from .common import check_int, labels_of, load_config, prepared, scores_of, top_labels

_TEXT_FIELDS = ("input_ids", "attention_mask", "token_type_ids", "text", "text_pair")


def _position_limit(config) -> Optional[int]:
    """Longest input the model's position table serves (RoBERTa's positions start after its pad id)."""
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        return None
    if getattr(config, "model_type", None) in ("roberta", "xlm-roberta", "camembert"):
        n -= (config.pad_token_id or 0) + 1
    return n


@dataclass(frozen=True)
class PreparedText:
    """A text request ready to batch: tokenized at submit (off the engine's lock), with the request's own
    fields (``top_k``, ``normalize``) and whether it came as text."""
    ids: List[int]
    mask: List[int]
    token_type_ids: Optional[List[int]]
    fields: Dict[str, Any]
    from_text: bool


class _TextBatching(BatchManager):
    """Token ids or text in, right-padded ``input_ids``/``attention_mask``/``token_type_ids`` out."""

    _extra_fields: Tuple[str, ...] = ()
    prepare_off_loop = True

    def __init__(self, max_batch_size: int = 8, pad_token_id: int = 0, vocab_size: Optional[int] = None,
                 max_length: Optional[int] = None, type_vocab_size: Optional[int] = None, tokenizer=None):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r}: must be an int >= 1")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length={max_length!r}: must be >= 1")
        self.max_batch_size = max_batch_size
        self.pad_token_id = int(pad_token_id or 0)
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.type_vocab_size = type_vocab_size
        self.tokenizer = tokenizer

    @staticmethod
    def _text_kwargs(path: str, config, max_batch_size: int, max_length: Optional[int]) -> Dict[str, Any]:
        tokenizer = None
        if has_tokenizer(path):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        limit = _position_limit(config)
        if max_length is None:
            max_length = limit
        elif limit is not None and max_length > limit:
            raise ValueError(f"max_length={max_length}: the model has only {limit} positions")
        pad = config.pad_token_id
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id
        return dict(max_batch_size=max_batch_size, pad_token_id=pad or 0, vocab_size=config.vocab_size,
                    max_length=max_length, type_vocab_size=getattr(config, "type_vocab_size", None),
                    tokenizer=tokenizer)

    # ---- checks at submit time -----------------------------------------------
    def validate(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise TypeError(f"a request is a dict with 'input_ids' or 'text', got {type(data).__name__}")
        unknown = set(data) - set(_TEXT_FIELDS) - set(self._extra_fields)
        if unknown:
            raise PayloadError(f"unknown request fields {sorted(unknown)}", sorted(unknown)[0])
        if ("input_ids" in data) == ("text" in data):
            raise PayloadError("exactly one of 'input_ids' and 'text' is required")
        if "text" in data:
            if self.tokenizer is None:
                raise PayloadError("text: this model's checkpoint has no tokenizer; send input_ids", "text")
            for key in ("text", "text_pair"):
                if key in data and (not isinstance(data[key], str) or not data[key]):
                    raise PayloadError(f"{key} must be a non-empty string", key)
            for key in ("attention_mask", "token_type_ids"):
                if key in data:
                    raise PayloadError(f"{key} goes with input_ids, not with text", key)
        else:
            if "text_pair" in data:
                raise PayloadError("text_pair goes with text, not with input_ids", "text_pair")
            ids = int_list(data, "input_ids")
            if not ids:
                raise PayloadError("input_ids is empty", "input_ids")
            if min(ids) < 0 or (self.vocab_size is not None and max(ids) >= self.vocab_size):
                raise PayloadError(f"input_ids must lie in [0, {self.vocab_size}), got min {min(ids)} "
                                   f"max {max(ids)}", "input_ids")
            if self.max_length is not None and len(ids) > self.max_length:
                raise PayloadError(f"input_ids has {len(ids)} tokens; the model takes at most {self.max_length}",
                                   "input_ids")
            if "attention_mask" in data:
                mask = int_list(data, "attention_mask")
                if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
                    raise PayloadError("attention_mask must be 0/1 values of the same length as input_ids",
                                       "attention_mask")
                if not any(mask):
                    raise PayloadError("attention_mask hides every token", "attention_mask")
            if "token_type_ids" in data:
                tt = int_list(data, "token_type_ids")
                if len(tt) != len(ids):
                    raise PayloadError("token_type_ids must have the same length as input_ids", "token_type_ids")
                if tt and (min(tt) < 0 or (self.type_vocab_size is not None and max(tt) >= self.type_vocab_size)):
                    raise PayloadError(f"token_type_ids must lie in [0, {self.type_vocab_size})", "token_type_ids")
        self._validate_extra(data)

    def _validate_extra(self, data: Dict[str, Any]) -> None:
        """Checks of the subclass's own request fields."""

    def prepare(self, data: Any) -> "PreparedText":
        self.validate(data)
        ids, mask, tt = self._encode(data)
        return PreparedText(ids, mask, tt, {k: data[k] for k in self._extra_fields if k in data}, "text" in data)

    # ---- batching ------------------------------------------------------------
    def _encode(self, data: Dict[str, Any]) -> Tuple[List[int], List[int], Optional[List[int]]]:
        if "text" in data:
            enc = self.tokenizer(data["text"], data.get("text_pair"), truncation=True,
                                 max_length=self.max_length)
            ids = list(enc["input_ids"])
            return ids, list(enc.get("attention_mask") or [1] * len(ids)), (
                list(enc["token_type_ids"]) if enc.get("token_type_ids") is not None else None)
        ids = int_list(data, "input_ids")
        mask = int_list(data, "attention_mask") if "attention_mask" in data else [1] * len(ids)
        tt = int_list(data, "token_type_ids") if "token_type_ids" in data else None
        return ids, mask, tt

    def _take(self, q: Deque[SubmitEntry]) -> List[Tuple[SubmitEntry, "PreparedText"]]:
        """Up to a batch of prepared requests (the engine prepares them at submit; a request handed to
        ``make_batch`` unprepared is prepared here, and one that fails waits to fail alone as the head)."""
        head = q.popleft()
        taken = [(head, prepared(self, head.data, PreparedText))]
        while q and len(taken) < self.max_batch_size:
            try:
                item = prepared(self, q[0].data, PreparedText)
            except Exception:  # noqa: BLE001 - it fails alone, as the next head
                break
            taken.append((q.popleft(), item))
        return taken

    def _pad(self, rows: List["PreparedText"]) -> Dict[str, torch.Tensor]:
        width = max(len(r.ids) for r in rows)
        n = len(rows)
        ids_t = torch.full((n, width), self.pad_token_id, dtype=torch.int64)
        mask_t = torch.zeros((n, width), dtype=torch.int64)
        tt_t = torch.zeros((n, width), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids_t[i, :len(r.ids)] = torch.tensor(r.ids, dtype=torch.int64)
            mask_t[i, :len(r.mask)] = torch.tensor(r.mask, dtype=torch.int64)
            if r.token_type_ids is not None:
                tt_t[i, :len(r.token_type_ids)] = torch.tensor(r.token_type_ids, dtype=torch.int64)
        batch = {"input_ids": ids_t, "attention_mask": mask_t}
        if any(r.token_type_ids is not None for r in rows):
            batch["token_type_ids"] = tt_t
        return batch


class TextClassificationBatchManager(_TextBatching):
    """Sequence classification (one answer per text) or token classification (one per token).

    Answers name labels from the model's ``config.id2label``. The request field
    ``top_k`` (sequence classification) asks for that many labels, best first.
    """

    _extra_fields = ("top_k",)

    def __init__(self, id2label: Optional[Dict[int, str]] = None, num_labels: Optional[int] = None,
                 task: str = "sequence", problem_type: Optional[str] = None, default_top_k: int = 1, **kw):
        super().__init__(**kw)
        if task not in ("sequence", "token"):
            raise ValueError(f"task={task!r}: must be 'sequence' or 'token'")
        self.labels = labels_of(id2label, num_labels)
        self.task = task
        self.problem_type = problem_type
        self.default_top_k = default_top_k

    @classmethod
    def for_checkpoint(cls, path: str, max_batch_size: int = 8, max_length: Optional[int] = None,
                       **kw) -> "TextClassificationBatchManager":
        """Labels, task (from ``config.architectures``), pad id, limits and tokenizer of a local checkpoint."""
        config = load_config(path)
        archs = config.architectures or []
        if not any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs):
            raise ValueError(f"checkpoint {path!r}: config.architectures={archs!r} has no sequence or token "
                             "classification head")
        task = "token" if any(a.endswith("ForTokenClassification") for a in archs) else "sequence"
        return cls(id2label=config.id2label, num_labels=config.num_labels, task=task,
                   problem_type=config.problem_type,
                   **cls._text_kwargs(path, config, max_batch_size, max_length), **kw)

    def _validate_extra(self, data: Dict[str, Any]) -> None:
        check_int(data, "top_k")

    def make_batch(self, q: Deque[SubmitEntry]) -> Tuple[TaskEntry, dict]:
        taken = self._take(q)
        rows = [r for _, r in taken]
        info = {"lengths": [len(r.ids) for r in rows],
                "top_k": [int(r.fields.get("top_k", self.default_top_k)) for r in rows]}
        if self.task == "token" and self.tokenizer is not None:
            info["tokens"] = [self.tokenizer.convert_ids_to_tokens(r.ids) if r.from_text else None for r in rows]
        return TaskEntry(tuple(e.uid for e, _ in taken), self._pad(rows)), info

    def split_batch(self, task_entry: TaskEntry, lengths: Sequence[int] = (), top_k: Sequence[int] = (),
                    tokens: Sequence[Optional[List[str]]] = (), **_) -> List[Tuple[Hashable, Any]]:
        logits = task_entry.batch["logits"]
        out = []
        for i, uid in enumerate(task_entry.uids):
            if self.task == "sequence":
                out.append((uid, top_labels(logits[i], self.labels, top_k[i] if top_k else 1, self.problem_type)))
                continue
            row = logits[i, :lengths[i]] if lengths else logits[i]
            scores = scores_of(row.float(), self.problem_type)
            best, idx = scores.max(-1)
            answer = {"labels": [self.labels[int(j)] for j in idx.tolist()],
                      "scores": [float(s) for s in best.tolist()],
                      "logits": [[float(x) for x in r] for r in row.tolist()]}
            if tokens and tokens[i] is not None:
                answer["tokens"] = list(tokens[i])
            out.append((uid, answer))
        return out


class EmbeddingBatchManager(_TextBatching):
    """Sentence embeddings from an encoder's last hidden states: 'mean' pooling (the default) averages the
    tokens the attention mask keeps; 'cls' takes the first token's state. Works with a bare backbone
    (``BertModel``) and with a classifier checkpoint, whose head is then skipped."""

    _extra_fields = ("normalize",)

    def __init__(self, pooling: str = "mean", **kw):
        super().__init__(**kw)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: must be one of {POOLINGS}")
        self.pooling = pooling

    @classmethod
    def for_checkpoint(cls, path: str, pooling: str = "mean", max_batch_size: int = 8,
                       max_length: Optional[int] = None, **kw) -> "EmbeddingBatchManager":
        config = load_config(path)
        return cls(pooling=pooling, **cls._text_kwargs(path, config, max_batch_size, max_length), **kw)

    def _validate_extra(self, data: Dict[str, Any]) -> None:
        v = data.get("normalize")
        if v is not None and not isinstance(v, bool):
            raise PayloadError(f"normalize={v!r}: must be true or false", "normalize")

    def make_batch(self, q: Deque[SubmitEntry]) -> Tuple[TaskEntry, dict]:
        taken = self._take(q)
        batch = self._pad([r for _, r in taken])
        batch["pooling"] = self.pooling
        return TaskEntry(tuple(e.uid for e, _ in taken), batch), {
            "normalize": [bool(r.fields.get("normalize", False)) for _, r in taken],
            "lengths": [len(r.ids) for _, r in taken]}

    def split_batch(self, task_entry: TaskEntry, normalize: Sequence[bool] = (), lengths: Sequence[int] = (),
                    **_) -> List[Tuple[Hashable, Any]]:
        emb = task_entry.batch["embeddings"].float()
        out = []
        for i, uid in enumerate(task_entry.uids):
            v = emb[i]
            if normalize and normalize[i]:
                v = torch.nn.functional.normalize(v, dim=-1)
            answer = {"embedding": [float(x) for x in v.tolist()], "pooling": self.pooling}
            if lengths:
                answer["tokens"] = lengths[i]
            out.append((uid, answer))
        return out


__all__ = ["PreparedText", "TextClassificationBatchManager", "EmbeddingBatchManager"]
