"""``RunningBatch``'s two ways of admitting sequences into a running batch, driven on an unsharded
transformers model in process: one padded forward (``step_inputs``), or a decode forward of the running rows
and a prefill forward of the new ones joined afterwards (``messages.Step.prefill_apart``). Either way each
sequence's greedy tokens equal transformers' ``generate`` of its prompt alone."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from computron.models.running import RunningBatch
from computron.testing.zoo import random_causal_lm, reference_generate

pytestmark = pytest.mark.unit

# step -> prompts admitted at that step; lengths chosen so admissions pad running rows a lot (20 vs 1)
ADMISSIONS = {0: [[5, 9, 13, 17, 21]], 2: [list(range(30, 42)), [7, 8, 9]], 3: [list(range(60, 80))],
              5: [[11, 12]]}
MAX_TOKENS = 6


def _forward(model, ids, mask, cache, new: int) -> torch.Tensor:
    """The last column's logits, positions from the mask as ``CausalLMRunner._positions`` gives them."""
    kwargs = {}
    if model.config.model_type != "opt":
        pos = mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = pos.masked_fill(mask == 0, 1)[:, -new:]
    kwargs["cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"] = cache
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs)
    return out.logits[:, -1, :]


def _serve(model, apart: bool) -> dict:
    """Every sequence's greedy tokens, admitting as ``ADMISSIONS`` says, split or padded."""
    rb, produced, sid = RunningBatch(), {}, 0
    pad = model.config.pad_token_id
    with torch.inference_mode():
        for step in range(max(ADMISSIONS) + MAX_TOKENS + 1):
            prompts = ADMISSIONS.get(step, [])
            if not len(rb) and not prompts:
                continue
            specs = []
            for p in prompts:
                specs.append(SimpleNamespace(sid=sid, max_tokens=MAX_TOKENS))
                produced[sid] = (p, [])
                sid += 1
            if apart and len(rb) and prompts:
                ids, mask = rb.decode_inputs()
                new_ids, new_mask, width, new_cache = rb.prefill_inputs(prompts, pad, torch.device("cpu"))
                logits = torch.cat([_forward(model, ids, mask, rb.cache, 1),
                                    _forward(model, new_ids, new_mask, new_cache, width)])
                mask = rb.merge_prefilled(mask, new_mask, new_cache)
            else:
                ids, mask, width = rb.step_inputs(prompts, pad, torch.device("cpu"))
                logits = _forward(model, ids, mask, rb.cache, width)
            tokens = logits.argmax(-1)
            rb.joined(specs, {}, mask, tokens)
            for s, t in zip(rb.sids, tokens.tolist()):
                produced[s][1].append(t)
            rb.drop(rb.ended([False] * len(rb)))
    assert not len(rb)
    return produced


@pytest.mark.parametrize("name", ["opt-tiny", "llama-tiny"])
def test_split_and_padded_admission_equal_generate(name):
    model = random_causal_lm(name, seed=3)
    model.generation_config.eos_token_id = None  # every sequence runs its MAX_TOKENS
    padded, apart = _serve(model, apart=False), _serve(model, apart=True)
    assert len(padded) == len(apart) == sum(len(p) for p in ADMISSIONS.values())
    for sid, (prompt, tokens) in padded.items():
        want = reference_generate(model, prompt, MAX_TOKENS).tolist()
        assert tokens == want, f"padded, sequence {sid}"
        assert apart[sid][1] == want, f"apart, sequence {sid}"
