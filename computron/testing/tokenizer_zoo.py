"""Small tokenizers trained locally, saved beside zoo checkpoints: the one tokenizer trainer.

Nothing is downloaded: tokenizers are trained with ``tokenizers`` on text that
ships with this package (``default_corpus``: its own sources, and the
repository's READMEs when present), and saved with ``save_pretrained`` next to
a random-weight checkpoint, so ``AutoTokenizer.from_pretrained(path,
local_files_only=True)`` loads them like any local checkpoint's tokenizer.

``train_bpe`` makes the byte-level BPE of the causal LMs: its special tokens
take the ids the zoo's OPT configs expect: ``<s>`` 0, ``<pad>`` 1
(pad_token_id), ``</s>`` 2 (bos_token_id = eos_token_id, as OPT's own tokenizer
uses it), ``<unk>`` 3, and encoding prepends ``</s>`` as OPT's does.
``train_tokenizer`` makes the encoders' tokenizers from the same corpus:
WordPiece for BERT, byte-level BPE (``train_bpe``) for RoBERTa.
"""
from __future__ import annotations

import glob
import os
import tempfile
from typing import Iterable, List, Optional, Sequence

from ..loading import has_tokenizer

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A minimal chat template: role markers and one message per line."""

_ENCODER_SPECIAL = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                    "roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]}


def default_corpus() -> List[str]:
    """Text files to train on: the ``computron`` package's sources plus the repository's READMEs when present."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = os.path.dirname(pkg)
    files = sorted(glob.glob(os.path.join(pkg, "*.py")))
    for extra in ("README.md", "benchmarks/README.md", "experiments/README.md"):
        p = os.path.join(repo, extra)
        if os.path.isfile(p):
            files.append(p)
    return files


def train_bpe(files: Optional[Sequence[str]] = None, vocab_size: int = 512,
              special_tokens: Iterable[str] = SPECIAL_TOKENS, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab_size`` ids (special tokens first).

    Byte-level: every byte has a token, so any text encodes and multi-byte characters
    may span several tokens (what incremental detokenization must get right). With a
    ``</s>`` among the special tokens, encoding prepends it (OPT's convention).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    special = list(special_tokens)
    files = list(files or default_corpus())
    if not files:
        raise ValueError("train_bpe: no training text files")
    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in special else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special):
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least "
                         f"{len(alphabet) + len(special)} ids")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=min_frequency)
    tok.train(files, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} ids, more than vocab_size={vocab_size}")
    if "</s>" in special:
        bos = tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A </s> $B",
                                                           special_tokens=[("</s>", bos)])
    return tok


def _train_wordpiece(files: Sequence[str], vocab_size: int, special: Sequence[str]):
    """A lower-casing WordPiece tokenizer with BERT's ``[CLS] $A [SEP]`` framing."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train(list(files), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                                     show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return tok


def train_tokenizer(kind: str, vocab_size: int = 512, max_length: int = 64, files: Optional[Sequence[str]] = None):
    """A transformers fast tokenizer for encoder family ``kind`` ('bert': WordPiece, 'roberta': byte-level
    BPE with RoBERTa's ``<s> $A </s>`` framing), trained on ``files`` (``default_corpus()`` when None)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    if kind not in _ENCODER_SPECIAL:
        raise ValueError(f"kind={kind!r}: tokenizers exist for 'bert' and 'roberta'")
    files = list(files or default_corpus())
    special = _ENCODER_SPECIAL[kind]
    if kind == "bert":
        tok = _train_wordpiece(files, vocab_size, special)
        names = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                     mask_token="[MASK]")
    else:
        tok = train_bpe(files, vocab_size, special, min_frequency=0)
        tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                          ("<s>", tok.token_to_id("<s>")))
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", cls_token="<s>",
                     sep_token="</s>", mask_token="<mask>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **names)


def save_tokenizer(tok, path: str, chat_template: Optional[str] = CHAT_TEMPLATE) -> str:
    """Save ``tok`` as a transformers fast tokenizer in ``path`` (OPT-style special tokens)."""
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def save_checkpoint_with_tokenizer(name: str, path: str, seed: int = 0, dtype: str = "float32",
                                   files: Optional[Sequence[str]] = None,
                                   chat_template: Optional[str] = CHAT_TEMPLATE, tokenizer=None, **cfg) -> str:
    """A random-weight zoo checkpoint of shape ``name`` plus a locally trained tokenizer of the
    checkpoint's vocabulary size, both in ``path``. An existing checkpoint and tokenizer are kept.
    ``tokenizer`` (from :func:`train_bpe`) saves training one per checkpoint."""
    from . import zoo
    zoo.save_random_causal_lm(name, path, seed=seed, dtype=dtype, **cfg)
    if has_tokenizer(path):
        return path
    vocab = zoo.hf_config(name, **cfg).vocab_size
    tok = tokenizer if tokenizer is not None else train_bpe(files, vocab_size=vocab)
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, more than the model's vocab_size={vocab}")
    # write aside, then move each file in: a reader never sees half a tokenizer.json
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=path)
    save_tokenizer(tok, tmp, chat_template)
    for f in sorted(os.listdir(tmp), key=lambda f: f == "tokenizer_config.json"):  # the config last
        os.replace(os.path.join(tmp, f), os.path.join(path, f))
    os.rmdir(tmp)
    return path


__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "default_corpus", "train_bpe", "train_tokenizer", "save_tokenizer",
           "has_tokenizer", "save_checkpoint_with_tokenizer"]
