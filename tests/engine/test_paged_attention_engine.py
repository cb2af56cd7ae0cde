"""The engine with ``attention_backend='paged'`` (FlexAttention over the pool in place) serves transformers'
greedy tokens: llama and gemma3_text (sliding window on half its layers) at TP=1, TP=2 and PP=2, two models
for one device slot (each parked and restored between tokens), prompts of mixed lengths joining running ones
in one ragged row (a mixed step) and leaving at different lengths."""
import asyncio

import psutil
import pytest
from family_configs import FAMILIES
from helpers import greedy_reference, multiprocessing_servers
from test_families import KV_SWAP, LAYOUTS, REQUEST_TIMEOUT_S, _children, _hf, _model_config, _prompts

from computron import EngineConfig, LaunchEngine

SERVED = ("llama", "gemma3_text")
LENGTHS = (3, 11, 6, 17)
TOKENS = (10, 5, 8, 6)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("paged-attention"))
    return {name: FAMILIES[name](root) for name in SERVED}


WORKER_COMPILE_BUG = pytest.mark.xfail(
    reason="in a CPU worker at TP=1 (one stage, or PP=2) the first paged step fails in inductor's FlexAttention "
           "C++ template (CppCompileError 'cur_kvSplitSize7 was not declared', torch 2.13), though the same model "
           "compiles in process (tests/unit/test_paged_attention.py) and in TP=2 workers: to be found before "
           "'paged' is a CPU default", raises=Exception, strict=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if LAYOUTS[k][0] > 1 else WORKER_COMPILE_BUG)
                                    for k in LAYOUTS])
def test_paged_backend_matches_hf(layout, ckpts):
    tp, pp = LAYOUTS[layout]
    config = EngineConfig(max_loaded=1, max_batch_size=8, quantum_ms=1.0, kv_swap=KV_SWAP[layout],
                          kv_cache="paged", kv_block_size=4, attention_backend="paged", compile_decode="off")
    before = _children()
    engine = LaunchEngine(config, [_model_config(n, ckpts[n]) for n in SERVED], tp, pp)
    prompts = {f: _prompts(f + "-flex", LENGTHS) for f in SERVED}
    try:
        async def one(family, i, after=None):
            if after is not None:
                await after.wait()
            toks = []
            async for t in engine.stream(family, {"input_ids": prompts[family][i], "max_tokens": TOKENS[i]},
                                         timeout=REQUEST_TIMEOUT_S * 4):
                toks.append(int(t))
                if i == 0 and len(toks) == 2:
                    started[family].set()
            started[family].set()
            return family, i, toks

        started = {}

        async def go():
            started.update({f: asyncio.Event() for f in SERVED})
            calls = [one(f, 0) for f in SERVED] + [one(f, i, started[f]) for f in SERVED
                                                    for i in range(1, len(LENGTHS))]
            return await asyncio.gather(*calls)

        for family, i, toks in asyncio.run(go()):
            want = greedy_reference(_hf(ckpts[family]), prompts[family][i], TOKENS[i]).tolist()
            assert toks == want, f"{family} {layout}, prompt {i}: engine {toks} != {want}"
    finally:
        engine.close()
        left = [psutil.Process(p) for p in _children() - before - multiprocessing_servers() if psutil.pid_exists(p)]
        _, alive = psutil.wait_procs(left, timeout=15)
        for p in alive:
            p.kill()
        assert not alive, f"the paged-attention {layout} engine left workers behind"
