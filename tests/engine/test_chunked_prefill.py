"""Chunked prefill on the paged KV pool (``kv_cache='paged'``, ``max_step_tokens=8``): prompts longer than a
step's budget are prefilled over several steps while the running sequences keep decoding; greedy outputs
equal transformers' ``generate`` token for token, and a request cancelled mid-prefill leaves the others
unchanged."""
import asyncio

import pytest
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo

pytestmark = pytest.mark.timeout(300)

BUDGET = 8


def _prompt(i, n):
    return [2] + [10 + (7 * i + 3 * k) % 400 for k in range(n - 1)]


def test_chunked_prefill_matches_hf_keeps_decoding_and_cancels_mid_prefill(checkpoints):
    path = checkpoints["llama0"]
    ref = zoo.load_causal_lm(path)
    config = EngineConfig(max_loaded=1, max_batch_size=8, kv_cache="paged", kv_block_size=4,
                          max_step_tokens=BUDGET)
    lengths = (3, 11, 6, 17, 30)

    async def go():
        engine = LaunchEngine(config, [ModelConfig("a", zoo.load_causal_lm, {"path": path})], 1, 1)
        async with engine:
            # prompts of mixed lengths at once (some over a step's budget)
            mixed = await asyncio.gather(*[engine.submit("a", {"input_ids": _prompt(i, n), "max_tokens": 9})
                                           for i, n in enumerate(lengths)])

            # a decoding sequence keeps getting tokens while a long prompt is prefilled in chunks
            events, long_started = [], asyncio.Event()
            short_prompt, long_prompt = _prompt(7, 4), _prompt(8, 45)

            async def short():
                toks = []
                async for t in engine.stream("a", {"input_ids": short_prompt, "max_tokens": 24}):
                    toks.append(int(t))
                    events.append("short")
                    if len(toks) == 2:
                        long_started.set()
                return toks

            async def long(prompt, tag):
                await long_started.wait()
                toks = []
                async for t in engine.stream("a", {"input_ids": prompt, "max_tokens": 5}):
                    toks.append(int(t))
                    events.append(tag)
                return toks

            got_short, got_long = await asyncio.gather(short(), long(long_prompt, "long"))

            # a request cancelled mid-prefill: the decoding one counts the steps, the long one never runs
            long_started.clear()
            doomed = asyncio.ensure_future(long(_prompt(9, 60), "doomed"))
            survivor = []
            async for t in engine.stream("a", {"input_ids": short_prompt, "max_tokens": 24}):
                survivor.append(int(t))
                if len(survivor) == 2:
                    long_started.set()
                if len(survivor) == 5:
                    doomed.cancel()
            after = await engine.submit("a", {"input_ids": long_prompt, "max_tokens": 5})
            steps = engine.metrics("step")
        return mixed, got_short, got_long, events, doomed, survivor, after, steps

    mixed, got_short, got_long, events, doomed, survivor, after, steps = asyncio.run(go())
    for (i, n), toks in zip(enumerate(lengths), mixed):
        assert toks.tolist() == greedy_reference(ref, _prompt(i, n), 9).tolist(), f"prompt {i} ({n} tokens)"
    want_short = greedy_reference(ref, [2] + [10 + (49 + 3 * k) % 400 for k in range(3)], 24).tolist()
    assert got_short == want_short and survivor == want_short
    assert got_long == greedy_reference(ref, _prompt(8, 45), 5).tolist()
    assert after.tolist() == got_long
    # 45 prompt tokens at most 7 a step beside the decoding one: >= 6 steps, each giving the short one a token
    before_long = events[events.index("short", events.index("short") + 1) + 1:events.index("long")]
    assert before_long.count("short") >= 5, events
    assert doomed.cancelled() and "doomed" not in events
    assert max(s.prefill_tokens for s in steps) <= BUDGET


@pytest.mark.parametrize("kv_swap", ["recompute", "offload"])
def test_chunked_prefill_across_preemptions(checkpoints, kv_swap):
    """Two models for one device slot, switched between steps: sequences mid-prefill are parked with their
    blocks (offload) or dropped and prefilled again from the start (recompute); outputs still equal HF's."""
    paths = {"a": checkpoints["llama0"], "b": checkpoints["opt0"]}
    config = EngineConfig(max_loaded=1, max_batch_size=8, kv_cache="paged", kv_block_size=4, quantum_ms=1.0,
                          kv_swap=kv_swap, max_step_tokens=BUDGET)
    lengths = (40, 5, 27)

    async def go():
        engine = LaunchEngine(config, [ModelConfig(m, zoo.load_causal_lm, {"path": p}) for m, p in paths.items()],
                              1, 1)
        async with engine:
            got = await asyncio.gather(*[engine.submit(m, {"input_ids": _prompt(i, n), "max_tokens": 6})
                                         for m in paths for i, n in enumerate(lengths)])
            return got, engine.metrics("preemption")

    got, preemptions = asyncio.run(go())
    calls = [(m, i, n) for m in paths for i, n in enumerate(lengths)]
    for (m, i, n), toks in zip(calls, got):
        assert toks.tolist() == greedy_reference(paths[m], _prompt(i, n), 6).tolist(), f"{m} prompt {i}"
    assert preemptions, "the two models were never switched between steps"
