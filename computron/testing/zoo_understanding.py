"""Tiny language- and image-understanding checkpoints, hub-free (the encoder side of ``zoo``).

Seeded random BERT, RoBERTa and ViT models with a task head and a label set
(``config.id2label``), written with ``save_pretrained`` together with what a
batch manager reads from a checkpoint: a tokenizer trained by
``tokenizer_zoo.train_tokenizer`` (WordPiece for BERT, byte-level BPE for
RoBERTa) on this repository's own text, or a ViT image processor config.
Nothing is downloaded; ``loading.load_encoder`` reads them back from the local
directory, the path a user's own fine-tune takes.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch

from ..loading import torch_dtype
from .tokenizer_zoo import train_tokenizer
from .zoo import write_checkpoint

# name: (hidden, layers, intermediate, heads)
ENCODER_SHAPES = {
    "tiny": (32, 4, 64, 4),
    "small": (256, 4, 1024, 4),
    "base": (768, 12, 3072, 12),
    "large": (1024, 24, 4096, 16),
}
KINDS = ("bert", "roberta", "vit")
TASKS = ("sequence", "token", "image", "base")
_ARCH = {("bert", "sequence"): "BertForSequenceClassification", ("bert", "token"): "BertForTokenClassification",
         ("bert", "base"): "BertModel", ("roberta", "sequence"): "RobertaForSequenceClassification",
         ("roberta", "token"): "RobertaForTokenClassification", ("roberta", "base"): "RobertaModel",
         ("vit", "image"): "ViTForImageClassification", ("vit", "base"): "ViTModel"}

LABEL_SETS: Dict[str, List[str]] = {
    "sentiment": ["negative", "positive"],
    "topic": ["world", "sports", "business", "science"],
    "emotion": ["anger", "fear", "joy", "love", "sadness", "surprise"],
    "spam": ["ham", "spam"],
    "ner": ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"],
    "objects": ["cat", "dog", "bird", "car", "tree", "house", "boat", "flower"],
    "digits": [str(d) for d in range(10)],
}
IMAGE_SIZE, PATCH_SIZE = 32, 8


def encoder_config(kind: str, shape: str = "tiny", labels: Optional[Sequence[str]] = None, vocab_size: int = 512,
                   max_positions: int = 64, image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE,
                   initializer_range: float = 0.1):
    """A transformers config of family ``kind`` and size ``shape``, with ``labels`` as id2label."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
    if shape not in ENCODER_SHAPES:
        raise ValueError(f"shape={shape!r}: must be one of {sorted(ENCODER_SHAPES)}")
    h, n, f, a = ENCODER_SHAPES[shape]
    common = dict(hidden_size=h, num_hidden_layers=n, intermediate_size=f, num_attention_heads=a,
                  initializer_range=initializer_range)
    if labels is not None:
        common["id2label"] = {i: str(lab) for i, lab in enumerate(labels)}
        common["label2id"] = {str(lab): i for i, lab in enumerate(labels)}
    if kind == "bert":
        from transformers import BertConfig
        return BertConfig(vocab_size=vocab_size, max_position_embeddings=max_positions, pad_token_id=0, **common)
    if kind == "roberta":
        from transformers import RobertaConfig  # positions start after padding_idx: two more rows
        return RobertaConfig(vocab_size=vocab_size, max_position_embeddings=max_positions + 2, pad_token_id=1,
                             bos_token_id=0, eos_token_id=2, type_vocab_size=1, **common)
    from transformers import ViTConfig
    return ViTConfig(image_size=image_size, patch_size=patch_size, num_channels=3, **common)


def random_encoder(kind: str, task: str = "sequence", seed: int = 0, labels: Optional[Sequence[str]] = None,
                   shape: str = "tiny", dtype: str = "float32", **cfg):
    """A seeded random model of family ``kind`` with a ``task`` head ('sequence', 'token', 'image', 'base')."""
    import transformers
    if (kind, task) not in _ARCH:
        raise ValueError(f"task={task!r} does not exist for kind={kind!r}; "
                         f"known: {sorted(t for k, t in _ARCH if k == kind)}")
    if labels is None and task != "base":
        labels = LABEL_SETS["objects" if kind == "vit" else "ner" if task == "token" else "sentiment"]
    config = encoder_config(kind, shape, labels=labels, **cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH[(kind, task)])(config)
    return model.to(torch_dtype(dtype, f"random_encoder({kind!r})")).eval()


def image_processor(config):
    """A ViT image processor for ``config``'s image size (resize, rescale, normalise with mean/std 0.5)."""
    try:
        from transformers import ViTImageProcessorPil as cls  # needs no torchvision
    except ImportError:  # older transformers
        from transformers import ViTImageProcessor as cls
    return cls(do_resize=True, size={"height": config.image_size, "width": config.image_size},
               do_rescale=True, do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def save_random_encoder(kind: str, path: str, task: str = "sequence", seed: int = 0,
                        labels: Optional[Sequence[str]] = None, tokenizer: bool = True, **kw) -> str:
    """Write a seeded random ``kind``/``task`` checkpoint to ``path`` with its tokenizer (text) or image
    processor (ViT); return ``path``. An existing checkpoint is kept; concurrent writers are safe."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok = train_tokenizer(kind, max_length=kw.get("max_positions", 64)) if tokenizer and kind != "vit" else None
    if tok is not None:
        kw.setdefault("vocab_size", len(tok))
    model = random_encoder(kind, task, seed=seed, labels=labels, **kw)

    def write(tmp):
        model.save_pretrained(tmp)
        if tok is not None:
            tok.save_pretrained(tmp)
        if kind == "vit":
            image_processor(model.config).save_pretrained(tmp)
    return write_checkpoint(path, write)


__all__ = ["ENCODER_SHAPES", "LABEL_SETS", "encoder_config", "random_encoder", "train_tokenizer",
           "image_processor", "save_random_encoder", "KINDS", "TASKS", "IMAGE_SIZE", "PATCH_SIZE"]
