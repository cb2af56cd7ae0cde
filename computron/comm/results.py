"""What the master tells workers about a sequence's grammar, and what runners return (``models.base``):
the parts of the typed messages (``messages``) that carry data, not commands."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class GrammarBlob:
    """A grammar compiled on the master, as the sampling rank rebuilds it: xgrammar's serialized compiled
    grammar (``key`` names it for the worker's cache) and how the master made its tokenizer info, which the
    worker makes again once (from the model's checkpoint directory, which every rank reads its weights
    from): far smaller than the info itself, which lists the whole vocabulary."""
    key: str
    grammar_json: str
    tokenizer_path: str
    vocab_size: Optional[int] = None
    stop_ids: Tuple[int, ...] = ()


GENERATION_FIELDS = ("eos_token_id", "temperature", "top_p", "top_k", "do_sample", "max_new_tokens",
                     "repetition_penalty")
"""The fields of a generation config (``generation_config.json``) the master reads (``batching.generation``)."""


@dataclass(frozen=True)
class BatchingDefaults:
    """What a batch manager on the master needs to know about a generative model's token ids."""
    pad_token_id: int
    eos_token_id: Any
    """One id, a list of them (Llama 3), or None."""
    vocab_size: int
    max_positions: Optional[int] = None
    generation: Optional[Dict[str, Any]] = None
    """The ``GENERATION_FIELDS`` the model's own ``generation_config`` sets (None: not reported): what the
    master takes when it knows no checkpoint directory of the model to read generation_config.json from."""

    @classmethod
    def from_config(cls, config, generation_config=None) -> "BatchingDefaults":
        """From a transformers config (no pad id: 0) and the model's ``generation_config``, if given."""
        generation = None
        if generation_config is not None:
            values = generation_config.to_diff_dict()  # the fields set, not transformers' defaults
            generation = {k: values[k] for k in GENERATION_FIELDS if values.get(k) is not None}
        return cls(pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
                   eos_token_id=config.eos_token_id, vocab_size=config.vocab_size,
                   max_positions=getattr(config, "max_position_embeddings", None), generation=generation)

    def as_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of ``CausalLMBatchManager``."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One generation step on one rank (every rank computes all of it).

    ``sids[i]`` got ``tokens[i]`` in this step; ``ended`` lists the sequences that
    ended with it (EOS or max_tokens) and left the running batch on every rank;
    ``running`` sequences stay.
    """
    sids: Tuple[int, ...] = ()
    tokens: Tuple[int, ...] = ()
    ended: Tuple[int, ...] = ()
    running: int = 0
    kv_restored_bytes: int = 0
    """KV cache bytes of paused sequences brought back from host memory at the start of this step."""
    kv_restore_s: float = 0.0
    logprobs: Tuple[Any, ...] = ()
    """Aligned with ``sids`` where some sequence asked for logprobs: None, or ``(logprob, ((id, logprob), ...))``
    of the token it got (raw: log_softmax of the model's logits), its top alternatives most likely first."""
    prompt_logprobs: Dict[int, Tuple[Any, ...]] = field(default_factory=dict)
    """sid -> one entry per prompt token (the first None, the others ``(token, logprob, top)``), for the
    admitted sequences that asked for them."""
    prefill_tokens: int = 0
    """Prompt tokens this step's prefill actually ran (sequences with the same prompt admitted together
    share one prefill row)."""


@dataclass(frozen=True, kw_only=True)
class ParkResult:
    """A preempted model's running sequences, put aside before its weights leave the device."""
    kv_parked_bytes: int = 0
    """KV cache bytes of paused sequences moved to host memory (this rank)."""
    kv_park_s: float = 0.0
    gen_states: Dict[int, bytes] = field(default_factory=dict)
    """Output rank: generator states of sampled sequences dropped for recompute."""


