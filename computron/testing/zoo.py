"""Causal-LM fixtures: model shapes by name and hub-free random models and checkpoints.

Nothing here downloads: shapes of the published OPT sizes are written out,
weights are random (seeded), and checkpoints are written with
``save_pretrained``, to be read back by ``loading.load_causal_lm`` from the
local directory, the same code path a user's own checkpoint takes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import torch

from ..loading import checkpoint_dtype, describe_model_fn, torch_dtype

# name: (hidden, layers, ffn, heads)
OPT_SHAPES = {
    "opt-tiny": (64, 4, 128, 4),
    "opt-small": (256, 8, 1024, 8),
    "opt-125m": (768, 12, 3072, 12),
    "opt-350m": (1024, 24, 4096, 16),
    "opt-1.3b": (2048, 24, 8192, 32),
    "opt-2.7b": (2560, 32, 10240, 32),
    "opt-6.7b": (4096, 32, 16384, 32),
    "opt-13b": (5120, 40, 20480, 40),
    "opt-30b": (7168, 48, 28672, 56),
}
LLAMA_SHAPES = {
    "llama-tiny": (64, 4, 128, 4, 2),
    "llama-small": (256, 8, 688, 8, 4),
}


def model_names():
    return sorted(OPT_SHAPES) + sorted(LLAMA_SHAPES)


def hf_config(name: str, vocab_size: Optional[int] = None, max_positions: int = 2048):
    """A transformers config with the shape of ``name``."""
    if name in OPT_SHAPES:
        from transformers import OPTConfig
        h, n, f, a = OPT_SHAPES[name]
        vocab = vocab_size or (512 if name in ("opt-tiny", "opt-small") else 50272)
        return OPTConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=n, ffn_dim=f,
                         num_attention_heads=a, word_embed_proj_dim=h, max_position_embeddings=max_positions,
                         pad_token_id=1, bos_token_id=2, eos_token_id=2)
    if name in LLAMA_SHAPES:
        from transformers import LlamaConfig
        h, n, f, a, kv = LLAMA_SHAPES[name]
        return LlamaConfig(vocab_size=vocab_size or 512, hidden_size=h, num_hidden_layers=n, intermediate_size=f,
                           num_attention_heads=a, num_key_value_heads=kv, max_position_embeddings=max_positions,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    raise ValueError(f"unknown model name {name!r}; known: {model_names()}")


def random_causal_lm(name: str, seed: int = 0, dtype: str = "float32", fast_init: bool = False, **cfg):
    """A causal LM of shape ``name`` with seeded random weights.

    ``fast_init`` skips transformers' per-layer initialisation and fills the
    weights from a pool of normal draws (copies run 10x faster than sampling on
    CPU: ~50 s less per 13 GB model), for large shapes where only timing matters.
    """
    from transformers import AutoModelForCausalLM
    config = hf_config(name, **cfg)
    torch.manual_seed(seed)
    where = f"random_causal_lm({name!r})"
    if not fast_init:
        model = AutoModelForCausalLM.from_config(config)
        return model.to(torch_dtype(dtype, where)).eval()
    with torch.device("meta"):  # no memory until to_empty, and then only in the target dtype
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype, where))
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave every parameter its own storage: share lm_head again
    _fill_from_pool(model, seed)
    if hasattr(model, "model") and hasattr(model.model, "rotary_emb"):  # buffers left empty by to_empty
        model.model.rotary_emb.__init__(config=config)
    return model.eval()


def _fill_from_pool(model, seed: int, pool_size: int = 1 << 22) -> None:
    """Copy N(0, 0.02) values from a seeded pool into every parameter, at seeded offsets."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    pool = torch.empty(2 * pool_size, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            for start in range(0, flat.numel(), pool_size):
                n = min(pool_size, flat.numel() - start)
                off = int(torch.randint(0, pool_size, (1,), generator=gen))
                flat[start:start + n].copy_(pool[off:off + n])


def save_random_causal_lm(name: str, path: str, seed: int = 0, dtype: str = "float32", **cfg) -> str:
    """Write a seeded random checkpoint of shape ``name`` to ``path`` (safetensors); return ``path``.

    An existing checkpoint at ``path`` is kept if it has the same dtype (a different dtype raises
    ``ValueError``: put the dtype in the directory name). Several processes may call this at once
    (every rank under torchrun): each writes a private directory and renames it into place, and the
    first rename wins.
    """
    torch_dtype(dtype, f"save_random_causal_lm({name!r})")
    if os.path.isfile(os.path.join(path, "config.json")):
        have = checkpoint_dtype(path)
        if have is not None and have != dtype:
            raise ValueError(f"checkpoint {path!r} already holds {have} weights, not dtype={dtype!r}: "
                             "use another directory (e.g. with the dtype in its name) or delete it")
        return path
    model = random_causal_lm(name, seed=seed, dtype=dtype, **cfg)
    return write_checkpoint(path, model.save_pretrained)


def write_checkpoint(path: str, write) -> str:
    """``write(tmp)`` a checkpoint into a private directory beside ``path``, then rename it into place:
    several processes may write the same checkpoint at once (every rank under torchrun) and the first
    rename wins. transformers' progress bars stay off meanwhile. Returns ``path``."""
    from transformers.utils import logging as hf_logging
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint
    try:
        write(tmp)
    except BaseException:  # any way out: no half-written checkpoint is left; re-raised
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    try:
        os.rename(tmp, path)
    except OSError:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    return path


def mlp(sizes=(64, 256, 64), seed: int = 0, dtype: str = "float32") -> torch.nn.Sequential:
    """Linear/ReLU stack: the MLP example and the simplest model to shard."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(torch_dtype(dtype, "mlp")).eval()


class Echo(torch.nn.Module):
    """Returns its input: isolates the engine's own overhead."""

    def forward(self, x):
        return x


def echo() -> Echo:
    return Echo()


def reference_generate(model, prompt, max_new_tokens: int) -> torch.Tensor:
    """The unsharded transformers model's greedy continuation of ``prompt``, cut after its first EOS:
    what a served model must answer, token for token."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.config.pad_token_id)
    new = out[0, len(prompt):]
    eos = model.config.eos_token_id
    hits = torch.isin(new, torch.tensor([eos] if isinstance(eos, int) else list(eos or []))).nonzero()
    return new[:int(hits[0]) + 1] if len(hits) else new



def _shape_config(kw):
    """What ``random_causal_lm(**kw)`` builds, for the preflight (``loading.describe_model_fn``)."""
    if kw.get("name") not in OPT_SHAPES.keys() | LLAMA_SHAPES.keys():
        return None
    config = hf_config(kw["name"], **{k: kw[k] for k in ("vocab_size", "max_positions") if k in kw})
    return config.to_dict(), f"shape {kw['name']!r}"


describe_model_fn(random_causal_lm, config_of=_shape_config, dtype_arg=True)

__all__ = ["OPT_SHAPES", "LLAMA_SHAPES", "model_names", "hf_config", "random_causal_lm", "save_random_causal_lm",
           "write_checkpoint", "mlp", "Echo", "echo", "reference_generate"]
