"""A checkpoint's generation_config.json end to end: an EOS id listed only there stops a served sequence
where transformers' ``generate`` (which reads the same file) stops, and its ``max_new_tokens`` is the
length of a request that sets no ``max_tokens``, while one that sets it wins."""
import asyncio
import json
import os

import pytest
import torch

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo

MAX_TOKENS = 12
DEFAULT_MAX = 2
"""generation_config.json's ``max_new_tokens``: shorter than the stop at the extra EOS id."""


def _new_tokens(model, prompt, **kw):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def _extra_eos(model, eos):
    """A prompt and a token its greedy continuation emits first at step >= DEFAULT_MAX (not the config's EOS,
    which must not come before it): computed, as it depends on the random weights."""
    model.generation_config.eos_token_id = None  # the continuation as it runs to MAX_TOKENS
    for start in range(3, 60, 7):
        prompt = list(range(start, start + 5))
        free = _new_tokens(model, prompt, max_new_tokens=MAX_TOKENS, do_sample=False)
        for k in range(DEFAULT_MAX, MAX_TOKENS - 1):
            if free[k] != eos and free[k] not in free[:k] and eos not in free[:k]:
                return prompt, free[k], free[:k + 1]
    pytest.fail("no prompt of the tiny Llama emits a new token late enough to serve as an extra EOS")


@pytest.mark.timeout(240)
def test_generation_config_eos_and_max_new_tokens_match_transformers(tmp_path):
    path = zoo.save_random_causal_lm("llama-tiny", str(tmp_path / "llama"), seed=0)
    eos = zoo.hf_config("llama-tiny").eos_token_id
    prompt, extra, expected = _extra_eos(zoo.load_causal_lm(path), eos)
    gc_file = os.path.join(path, "generation_config.json")
    with open(gc_file) as f:
        gc = json.load(f)
    gc.update(eos_token_id=[eos, extra], max_new_tokens=DEFAULT_MAX, do_sample=False)
    with open(gc_file, "w") as f:
        json.dump(gc, f)

    reference = zoo.load_causal_lm(path)  # from_pretrained reads generation_config.json
    assert reference.generation_config.eos_token_id == [eos, extra]
    stopped = _new_tokens(reference, prompt, max_new_tokens=MAX_TOKENS)
    assert stopped == expected and stopped[-1] == extra and len(stopped) < MAX_TOKENS
    defaulted = _new_tokens(reference, prompt)
    assert defaulted == expected[:DEFAULT_MAX]

    async def serve():
        mc = ModelConfig("lm", zoo.load_causal_lm, {"path": path})  # the engine builds its batch manager
        async with LaunchEngine(EngineConfig(), [mc], 1, 1) as engine:
            return await asyncio.gather(engine.submit("lm", {"input_ids": prompt, "max_tokens": MAX_TOKENS}),
                                        engine.submit("lm", {"input_ids": prompt}))
    served_stopped, served_defaulted = asyncio.run(serve())
    assert served_stopped.tolist() == stopped
    assert served_defaulted.tolist() == defaulted
