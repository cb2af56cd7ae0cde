"""Sampling controls, logprobs and shared prefills through the engine, token for token against the unsharded
transformers model (``sampling_reference``): swapped models with preempted sequences (KV parked or
recomputed), TP=2 and PP=2."""
import asyncio
import math

import pytest
import torch
from sampling_reference import prompt_scores, reference

from computron import EngineConfig, LaunchEngine, ModelConfig, PayloadError, zoo
from computron.engine.protocol import PromptLogprobs, TokenLogprob

pytestmark = pytest.mark.timeout(400)

# every control alone and some together, greedy and seeded (opt-tiny: EOS is 2)
CASES = [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7, "temperature": 1.3, "seed": 4},
    {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    {"presence_penalty": -1.0, "frequency_penalty": 2.0, "temperature": 0.9, "top_k": 40, "seed": 11},
    {"logit_bias": {"7": 6.0, 11: -100, 40: 3.5}},
    {"logit_bias": {2: 9.0}, "min_tokens": 5},
    {"logit_bias": {2: 9.0}, "ignore_eos": True},
    {"logit_bias": {2: 9.0}, "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [2]},
    {"min_p": 0.3, "temperature": 1.5, "seed": 8},
    {"min_p": 0.05, "temperature": 1.0, "top_p": 0.9, "seed": 21, "logit_bias": {"5": 2.0}},
    {"stop_token_ids": [None]},  # filled with the greedy answer's third token
    {"logprobs": 5, "repetition_penalty": 1.2, "temperature": 0.8, "seed": 2},
]


def _prompt(i):
    return [2] + [10 + (7 * i + k) % 400 for k in range(4 + i % 5)]


def _fill(case, model, prompt, n):
    if case.get("stop_token_ids") == [None]:
        greedy, _ = reference(model, prompt, n)
        return {**case, "stop_token_ids": [greedy[2]]}
    return case


def _ref_kwargs(case):
    kw = dict(case)
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    return kw


async def _collect(engine, model_id, data):
    return [t async for t in engine.stream(model_id, data)]


def _ids(items):
    return [x.token if isinstance(x, TokenLogprob) else x for x in items if not isinstance(x, PromptLogprobs)]


@pytest.mark.parametrize("kv_swap", ["offload", "recompute"])
def test_controls_equal_reference_across_swaps(checkpoints, kv_swap):
    """Two models on one slot (max_loaded=1) whose turns end every few steps: every control's sequences
    are preempted (parked, or dropped and recomputed) and resumed, and still equal the reference."""
    paths = {"a": checkpoints["opt0"], "b": checkpoints["opt1"]}
    refs = {m: zoo.load_causal_lm(p) for m, p in paths.items()}
    jobs = []
    for i, case in enumerate(CASES):
        for m in "ab":
            prompt, n = _prompt(i + (m == "b")), 10
            jobs.append((m, {"input_ids": prompt, "max_tokens": n, **_fill(case, refs[m], prompt, n)}))
    config = EngineConfig(max_loaded=1, max_batch_size=8, policy="quantum", quantum_ms=5, kv_swap=kv_swap)

    async def go():
        configs = [ModelConfig(m, zoo.load_causal_lm, {"path": p}) for m, p in paths.items()]
        async with LaunchEngine(config, configs, 1, 1) as engine:
            outs = await asyncio.gather(*[_collect(engine, m, d) for m, d in jobs])
            return outs, engine.metrics("preemption"), [r for r in engine.metrics("request") if r.error is None]

    outs, preemptions, reqs = asyncio.run(go())
    for (m, data), out in zip(jobs, outs):
        kw = {k: v for k, v in data.items() if k not in ("input_ids", "max_tokens")}
        want, lps = reference(refs[m], data["input_ids"], data["max_tokens"], **_ref_kwargs(kw))
        assert _ids(out) == want, (m, kw)
        if data.get("logprobs"):
            assert all(isinstance(x, TokenLogprob) for x in out)
            for got, (lp, top) in zip(out, lps):
                assert abs(got.logprob - lp) < 1e-4 and len(got.top) == 5
                assert [t for t, _ in got.top] == [t for t, _ in top]
                assert max(abs(a - b) for (_, a), (_, b) in zip(got.top, top)) < 1e-4
    assert preemptions and max(r.preemptions for r in reqs) >= 1
    if kv_swap == "recompute":
        assert sum(p.recomputed for p in preemptions) > 0


def test_repetition_penalty_equals_transformers_generate(checkpoints):
    """repetition_penalty greedy equals transformers' own ``generate(repetition_penalty=...)``."""
    path = checkpoints["llama0"]
    model = zoo.load_causal_lm(path)
    prompts = [_prompt(i) for i in range(3)]

    async def go():
        async with LaunchEngine(EngineConfig(max_batch_size=4), [ModelConfig("l", zoo.load_causal_lm,
                                                                              {"path": path})], 1, 1) as engine:
            return await asyncio.gather(*[engine.submit("l", {"input_ids": p, "max_tokens": 12,
                                                               "repetition_penalty": 1.6}) for p in prompts])

    outs = asyncio.run(go())
    for p, out in zip(prompts, outs):
        hf = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.6,
                            pad_token_id=model.config.pad_token_id)[0, len(p):].tolist()
        eos = model.config.eos_token_id
        if eos in hf:
            hf = hf[:hf.index(eos) + 1]
        assert out.tolist() == hf


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_controls_logprobs_and_shared_prefill_sharded(checkpoints, tp, pp):
    """At TP=2 and at PP=2: controls equal the reference; logprobs (generated and prompt) equal log_softmax
    of transformers' logits within 1e-4; three seeded sequences of one prompt admitted together prefill it
    once (the dynamic cache's shared prefill row; the paged pool shares a prompt's full blocks instead:
    tests/unit/test_paged_batch.py) and equal the same seeds run alone."""
    path = checkpoints["llama0"]
    model = zoo.load_causal_lm(path)
    eos = (model.config.eos_token_id,)
    cases = [CASES[0], CASES[3], CASES[5], CASES[8]]
    shared = _prompt(7)

    async def go():
        config = EngineConfig(max_batch_size=8, kv_cache="dynamic")
        async with LaunchEngine(config, [ModelConfig("l", zoo.load_causal_lm, {"path": path})], tp, pp) as engine:
            outs = await asyncio.gather(*[_collect(engine, "l", {"input_ids": _prompt(i), "max_tokens": 8, **c})
                                          for i, c in enumerate(cases)])
            lp = await _collect(engine, "l", {"input_ids": _prompt(2), "max_tokens": 6, "logprobs": 3,
                                              "prompt_logprobs": 2, "temperature": 1.0, "seed": 9})
            n0 = len(engine.metrics("step"))
            three = await asyncio.gather(*[_collect(engine, "l", {"input_ids": shared, "max_tokens": 6,
                                                                  "temperature": 1.0, "seed": 100 + i})
                                           for i in range(3)])
            steps = engine.metrics("step")[n0:]
            alone = [await _collect(engine, "l", {"input_ids": shared, "max_tokens": 6, "temperature": 1.0,
                                                  "seed": 100 + i}) for i in range(3)]
            return outs, lp, three, steps, alone

    outs, lp, three, steps, alone = asyncio.run(go())
    for i, (case, out) in enumerate(zip(cases, outs)):
        want, _ = reference(model, _prompt(i), 8, eos=eos, **_ref_kwargs(case))
        assert out == want, case
    # logprobs: one PromptLogprobs first, then a TokenLogprob per generated token
    assert isinstance(lp[0], PromptLogprobs) and all(isinstance(x, TokenLogprob) for x in lp[1:])
    prompt = _prompt(2)
    scores = prompt_scores(model, prompt)
    entries = lp[0].entries
    assert len(entries) == len(prompt) and entries[0] is None
    for j, e in enumerate(entries[1:]):
        assert e.token == prompt[j + 1] and abs(e.logprob - float(scores[j, prompt[j + 1]])) < 1e-4
        assert [t for t, _ in e.top] == torch.topk(scores[j], 2).indices.tolist()
    want, lps = reference(model, prompt, 6, eos=eos, temperature=1.0, seed=9, logprobs=3)
    assert [x.token for x in lp[1:]] == want
    for got, (ref_lp, top) in zip(lp[1:], lps):
        assert abs(got.logprob - ref_lp) < 1e-4 and math.isfinite(got.logprob)
        assert [t for t, _ in got.top] == [t for t, _ in top]
    # n = 3: one prefill row for the three, each equal to its seed alone
    first = next(s for s in steps if s.admitted)
    assert first.admitted == 3 and first.prefill_tokens == len(shared)
    assert three == alone and len({tuple(x) for x in three}) > 1


def test_bad_control_values_name_the_field(checkpoints):
    path = checkpoints["opt0"]
    bad = [("presence_penalty", 2.5), ("frequency_penalty", "x"), ("repetition_penalty", 0), ("min_p", 1.5),
           ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"99999": 1}),
           ("min_tokens", -1), ("ignore_eos", "yes"), ("stop_token_ids", [1, -2]), ("logprobs", 21),
           ("prompt_logprobs", True), ("grammar", {"type": "regex", "pattern": "x"})]

    async def go():
        async with LaunchEngine(EngineConfig(), [ModelConfig("o", zoo.load_causal_lm, {"path": path})],
                                1, 1) as engine:
            for field, value in bad:
                with pytest.raises(PayloadError) as info:
                    await engine.submit("o", {"input_ids": [2, 5], "max_tokens": 3, field: value})
                assert info.value.param == field, (field, value, info.value)

    asyncio.run(go())
