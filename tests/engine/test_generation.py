"""Greedy generation through the engine equals the unsharded transformers model, token for token."""
import asyncio

import pytest
import torch
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, OPTBatchManager, zoo

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23], [3], [40, 41, 42], [7, 7, 7, 7, 7, 7]]
MAX_TOKENS = [8, 6, 8, 5, 7, 8]


def _serve(path, name, tp, pp, prompts, max_tokens, max_batch_size=8, step_mode=True):
    """Serve one model; requests arrive in waves, each wave once the previous one has produced tokens,
    so under token-level generation later sequences join a batch that is already running."""
    bm = OPTBatchManager.for_config(zoo.hf_config(name), max_batch_size=max_batch_size)
    mc = ModelConfig("lm", zoo.load_causal_lm, {"path": path}, batch_manager=bm)

    async def go():
        engine = LaunchEngine(EngineConfig(step_mode=step_mode), [mc], tp, pp)
        async with engine:
            outs = [None] * len(prompts)
            if not step_mode:
                outs = await asyncio.gather(*[engine.submit("lm", {"input_ids": p, "max_tokens": n})
                                              for p, n in zip(prompts, max_tokens)])
                return outs, engine.metrics("batch")
            going = [asyncio.Event() for _ in prompts]

            async def consume(i):
                toks = []
                async for t in engine.stream("lm", {"input_ids": prompts[i], "max_tokens": max_tokens[i]}):
                    toks.append(t)
                    if len(toks) == 2:
                        going[i].set()
                going[i].set()
                outs[i] = torch.tensor(toks, dtype=torch.int64)
            tasks = []
            for i in range(len(prompts)):
                tasks.append(asyncio.create_task(consume(i)))
                if i % 2 == 0:
                    await going[i].wait()
            await asyncio.gather(*tasks)
            return outs, engine.metrics("step")
    return asyncio.run(go())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family,tp,pp,step_mode", [
    ("opt", 2, 1, True), ("opt", 1, 2, True), ("opt", 2, 2, True), ("llama", 2, 1, True),
    ("llama", 1, 2, True), ("llama", 2, 2, True), ("opt", 2, 2, False)])
def test_sharded_generation_matches_unsharded(checkpoints, family, tp, pp, step_mode):
    path = checkpoints[f"{family}0"]
    name = f"{family}-tiny"
    outs, batches = _serve(path, name, tp, pp, PROMPTS, MAX_TOKENS, step_mode=step_mode)
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outs):
        ref = greedy_reference(path, prompt, n)
        assert out.dtype == torch.int64
        assert out.tolist() == ref.tolist(), f"prompt {prompt}"
    assert all(set(b.rank_times) == set(range(tp * pp)) for b in batches)
    if step_mode:  # sequences joined a running batch at different steps, each admitted once
        assert max(b.running for b in batches) > 1
        assert sum(b.admitted for b in batches) == len(PROMPTS)
        assert len([b for b in batches if b.admitted]) >= 3
    else:  # concurrent requests were batched, and every request ran exactly once
        assert max(b.batch_size for b in batches) > 1
        assert sorted(u for b in batches for u in b.uids) == list(range(len(PROMPTS)))
