"""Batching generation requests for causal LMs (the paper's OPT request format).

A request is a dict: ``input_ids`` (a list of ints or a 1-D tensor; required),
optional ``attention_mask`` of the same length, ``max_tokens`` (new tokens,
default 16; the prompt and ``max_tokens`` must fit the model's positions), and
sampling parameters ``top_k``, ``top_p``, ``temperature`` (all absent, or
``temperature`` 0, means greedy) and ``seed``. A field that is absent or None
is unset: the model's generation config (``generation``: its checkpoint's
generation_config.json) fills it where it lists a default, and its EOS ids end
sequences too (``batching.generation``). A bad field raises
``PayloadError`` whose ``param`` names it. Requests with
the same sampling parameters are batched together, left-padded to the longest
prompt; each answer is cut to its own ``max_tokens`` and after its first EOS.
The answer is a 1-D LongTensor of the new token ids.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Deque, Dict, List, Mapping, Optional, Tuple, Union

import torch

from ..comm.messages import BatchingDefaults, SeqSpec
from ..comm.validation import int_list, is_finite_number, is_valid_seed
from ..errors import PayloadError
from ..loading import checkpoint_of
from .base import BatchManager, SubmitEntry, TaskEntry
from .controls import CONTROL_FIELDS, asks_controls, check_controls, spec_fields
from .generation import GenerationConfigError, GenerationDefaults, fill, merge_eos, read_generation_config

log = logging.getLogger(__name__)

_SAMPLING = ("top_k", "top_p", "temperature", "seed")


class CausalLMBatchManager(BatchManager):
    """Batches generation requests for any served causal LM (OPT, Llama, ...): the paper's OPTBatchManager."""

    def __init__(self, max_batch_size: int = 8, pad_token_id: int = 1, eos_token_id: Union[int, List[int], None] = 2,
                 vocab_size: Optional[int] = None, max_positions: Optional[int] = None,
                 default_max_tokens: int = 16, max_tokens_limit: int = 4096,
                 generation: Union[GenerationDefaults, Mapping[str, Any], None] = None,
                 tokenizer_path: Optional[str] = None):
        """``max_positions`` (the model's ``max_position_embeddings``) bounds prompt + ``max_tokens``;
        ``max_tokens_limit`` bounds ``max_tokens`` only for a model whose positions are unknown.
        ``generation``: the model's generation config (``GenerationDefaults``, or the fields of one as a
        dict): its EOS ids join ``eos_token_id``, its defaults fill the fields a request leaves unset.
        ``tokenizer_path``: a directory with the model's tokenizer, which requests with a ``grammar`` need
        (``batching.grammar``)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        if generation is not None and not isinstance(generation, GenerationDefaults):
            generation = GenerationDefaults.parse(generation, "the model's generation_config")
        self.generation: Optional[GenerationDefaults] = generation
        # one id, several (Llama 3 configs list them) or none; and those of the generation config
        eos_ids = merge_eos(eos_token_id, generation.eos_token_id if generation is not None else None)
        self.eos_token_id = eos_ids or None
        self._eos = torch.tensor(eos_ids, dtype=torch.int64)
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.tokenizer_path = tokenizer_path
        self._grammars = None
        self.request_level = False
        """Set by the engine when this model generates a whole batch per command (no token-level steps):
        then the sampling controls (``batching.controls``) are refused."""

    @classmethod
    def for_config(cls, hf_config, max_batch_size: int = 8, **kw) -> "CausalLMBatchManager":
        """Pad/EOS ids, vocabulary size and position limit taken from a transformers config (``kw`` wins)."""
        return cls(max_batch_size=max_batch_size, **{**BatchingDefaults.from_config(hf_config).as_kwargs(), **kw})

    @classmethod
    def for_checkpoint(cls, path: str, max_batch_size: int = 8, **kw) -> "CausalLMBatchManager":
        """``for_config`` of a checkpoint directory's config.json, with its generation_config.json (if any):
        ``GenerationConfigError`` naming the file and field when that cannot be read."""
        from .common import load_config
        from ..loading import has_tokenizer
        if has_tokenizer(path):
            kw.setdefault("tokenizer_path", path)
        return cls.for_config(load_config(path), max_batch_size, generation=read_generation_config(path), **kw)

    # ---- a request's unset fields --------------------------------------------
    def with_defaults(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """The request with the fields it leaves unset (absent or None) taken from the generation config
        (``generation.fill``: the request itself when it leaves none of them unset, as once prepared)."""
        if self.generation is None:
            return data
        ids = data.get("input_ids")
        return fill(data, self.generation, len(ids) if hasattr(ids, "__len__") else None, self.max_positions)

    def _max_tokens(self, data: Mapping[str, Any]) -> Any:
        n = data.get("max_tokens")
        return self.default_max_tokens if n is None else n

    def prepare(self, data: Any) -> Any:
        """``validate``, then the request with its unset fields filled (``with_defaults``)."""
        self.validate(data)
        return self.with_defaults(data)

    # ---- checks at submit time -----------------------------------------------
    def validate(self, data: Any) -> None:
        """Raise ``PayloadError`` naming the field (its ``param``) for a request the model cannot serve."""
        if not isinstance(data, dict):
            raise TypeError(f"a generation request is a dict with 'input_ids', got {type(data).__name__}")
        unknown = sorted(set(data) - {"input_ids", "attention_mask", "max_tokens", *_SAMPLING, *CONTROL_FIELDS})
        if unknown:
            raise PayloadError(f"unknown request fields {unknown}", unknown[0])
        if "input_ids" not in data:
            raise PayloadError("'input_ids' is required", "input_ids")
        ids = int_list(data, "input_ids")
        if not ids:
            raise PayloadError("input_ids is empty", "input_ids")
        if min(ids) < 0 or (self.vocab_size is not None and max(ids) >= self.vocab_size):
            raise PayloadError(f"input_ids must lie in [0, {self.vocab_size}), got min {min(ids)} max {max(ids)}",
                               "input_ids")
        if "attention_mask" in data:
            mask = int_list(data, "attention_mask")
            if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
                raise PayloadError("attention_mask must be 0/1 values of the same length as input_ids",
                                   "attention_mask")
            if not any(mask):
                raise PayloadError("attention_mask has no 1: the model would see no token at all", "attention_mask")
        max_tokens = self._max_tokens(self.with_defaults(data))
        self._check_length(len(ids), max_tokens)
        k = data.get("top_k")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise PayloadError(f"top_k={k!r}: must be an int >= 0", "top_k")
        p = data.get("top_p")
        if p is not None and (not is_finite_number(p) or not 0 < p <= 1):
            raise PayloadError(f"top_p={p!r}: must be a number in (0, 1]", "top_p")
        t = data.get("temperature")
        if t is not None and (not is_finite_number(t) or t < 0):
            raise PayloadError(f"temperature={t!r}: must be a finite number >= 0", "temperature")
        seed = data.get("seed")
        if seed is not None and not is_valid_seed(seed):
            raise PayloadError(f"seed={seed!r}: must be an int in [0, 2**63)", "seed")
        check_controls(data, self.vocab_size, max_tokens)
        asked = asks_controls(data)
        if asked is not None and self.request_level:
            raise PayloadError(f"{asked}: this model generates whole batches per command (step_mode off or "
                               f"paper mode), which has no per-sequence sampling controls", asked)
        if data.get("grammar") is not None:
            self.grammar(data["grammar"])

    def grammar(self, grammar: Any):
        """A request's grammar compiled for this model (``batching.grammar``; cached): PayloadError naming
        "grammar" if it is malformed, does not compile, or the model has no tokenizer to compile it with."""
        from .grammar import GrammarCompiler, grammar_key
        grammar_key(grammar)
        if self.tokenizer_path is None:
            raise PayloadError("grammar: this model has no tokenizer beside its checkpoint to compile a grammar "
                               "with", "grammar")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer_path, self.vocab_size, list(self.eos_token_id or ()))
        return self._grammars.compile(grammar)

    def _check_length(self, n_prompt: int, n: Any) -> None:
        """The prompt and ``max_tokens`` new tokens must fit the model's positions (``max_tokens_limit``
        bounds ``max_tokens`` only when the positions are unknown)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PayloadError(f"max_tokens={n!r}: must be an int >= 1", "max_tokens")
        limit = self.max_positions
        if limit is None:
            if n > self.max_tokens_limit:
                raise PayloadError(f"max_tokens={n}: must be at most {self.max_tokens_limit}", "max_tokens")
            return
        if n_prompt >= limit:
            raise PayloadError(f"the prompt has {n_prompt} tokens and the model has {limit} positions: it must "
                               f"leave room for at least one new token (at most {limit - 1} prompt tokens)",
                               "input_ids")
        if n_prompt + n > limit:
            raise PayloadError(f"max_tokens={n}: the prompt has {n_prompt} tokens and the model has {limit} "
                               f"positions, so max_tokens must be at most {limit - n_prompt}", "max_tokens")

    # ---- batching ------------------------------------------------------------
    def to_spec(self, uid: int, data: Dict[str, Any]) -> SeqSpec:
        """A validated request as the sequence workers run under token-level generation."""
        data = self.with_defaults(data)
        ids = int_list(data, "input_ids")
        if "attention_mask" in data:  # masked-out tokens are invisible to the model: leave them out
            ids = [t for t, m in zip(ids, int_list(data, "attention_mask")) if m]
        temperature = float(data.get("temperature") or 0.0)
        seed = data.get("seed")
        if seed is None:
            seed = random.getrandbits(63) if temperature > 0 else 0
        grammar = self.grammar(data["grammar"]) if data.get("grammar") is not None else None
        return SeqSpec(sid=uid, prompt=tuple(ids), max_tokens=int(self._max_tokens(data)),
                       eos=tuple(self.eos_token_id or ()), temperature=temperature, top_k=int(data.get("top_k") or 0),
                       top_p=float(data["top_p"]) if data.get("top_p") is not None else 1.0, seed=int(seed),
                       grammar=grammar, **spec_fields(data, self.vocab_size))

    @staticmethod
    def _key(data: Dict[str, Any]) -> Tuple:
        return tuple(data.get(k) for k in _SAMPLING)

    def make_batch(self, q: Deque[SubmitEntry]) -> Tuple[TaskEntry, dict]:
        head = q.popleft()
        self.validate(head.data)
        taken, datas = [head], [self.with_defaults(head.data)]
        key = self._key(datas[0])
        for entry in list(q):
            if len(taken) >= self.max_batch_size:
                break
            data = self.with_defaults(entry.data)
            if self._key(data) == key:
                q.remove(entry)
                taken.append(entry)
                datas.append(data)
        prompts = [int_list(d, "input_ids") for d in datas]
        masks = [int_list(d, "attention_mask") if "attention_mask" in d else [1] * len(p)
                 for d, p in zip(datas, prompts)]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(taken), width), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(taken), width), dtype=torch.int64)
        for i, (p, m) in enumerate(zip(prompts, masks)):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[i, width - len(m):] = torch.tensor(m, dtype=torch.int64)
        max_tokens = [int(self._max_tokens(d)) for d in datas]
        batch = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": max(max_tokens),
                 "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}
        batch.update({k: v for k, v in zip(_SAMPLING, key) if v is not None})
        return TaskEntry(tuple(e.uid for e in taken), batch), {"max_tokens": max_tokens}

    def split_batch(self, task_entry: TaskEntry, max_tokens: List[int] = (), **_) -> List[Tuple[Any, Any]]:
        out = task_entry.batch
        results = []
        for i, uid in enumerate(task_entry.uids):
            toks = out[i, :max_tokens[i]] if max_tokens else out[i]
            hits = torch.isin(toks, self._eos).nonzero()
            if len(hits):
                toks = toks[:int(hits[0]) + 1]
            results.append((uid, toks.clone()))
        return results


OPTBatchManager = CausalLMBatchManager  # the paper's (and EnergonAI's) name, kept as an alias


def batch_manager_for(batching: "Optional[BatchingDefaults]", max_batch_size: int = 0, model_config=None):
    """The batch manager a model gets as it is registered: its ModelConfig's own if it names one; else a
    CausalLMBatchManager for a causal LM (``batching``: what its workers reported of its token ids), with
    the generation_config.json of its checkpoint directory (``loading.checkpoint_of``), or else the
    ``generation_config`` its workers reported; batches of one for anything else. Logs (INFO) the EOS ids
    and defaults a generation config adds."""
    bm = getattr(model_config, "batch_manager", None)
    if bm is None:
        if batching is None:
            return BatchManager()
        kwargs = batching.as_kwargs()
        generation = kwargs.pop("generation", None)
        where = checkpoint_of(model_config) if model_config is not None else None
        try:  # the preflight read it already; a file broken since then is left out, not fatal
            generation = (read_generation_config(where[0]) if where is not None else None) or generation
            from ..loading import has_tokenizer
            tok = where[0] if where is not None and has_tokenizer(where[0]) else None
            bm = CausalLMBatchManager(max_batch_size=max_batch_size or 8, generation=generation,
                                      tokenizer_path=tok, **kwargs)
        except GenerationConfigError as exc:
            log.warning("model %r: generation config left out: %s", getattr(model_config, "model_id", None), exc)
            bm = CausalLMBatchManager(max_batch_size=max_batch_size or 8, **kwargs)
    gen = getattr(bm, "generation", None)
    if model_config is not None and isinstance(gen, GenerationDefaults):
        config_eos = merge_eos(batching.eos_token_id) if batching is not None else None
        adds = config_eos is None or any(i not in config_eos for i in gen.eos_token_id)
        (log.info if adds or gen.request_defaults() or gen.ignored else log.debug)(
            "model %r: from %s: %s; a sequence ends at any of %s", model_config.model_id, gen.source,
            gen.describe(), bm.eos_token_id)
    return bm
