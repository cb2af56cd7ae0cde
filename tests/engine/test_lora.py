"""LoRA adapters through the engine on real workers: one step mixing four adapters and the bare base answers
exactly as transformers + PEFT do for each adapter, split by TP and by PP, for OPT and Llama; sampling with a
seed does not depend on what else shares the step; adapters come and go while serving."""
import asyncio

import pytest

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.errors import UnknownModelError
from computron.testing.zoo_lora import save_random_lora

PROMPT = [5, 6, 7, 8, 9]
N = 6
RANKS = (4, 8, 8, 16)


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    """Four adapters (different ranks, one with rsLoRA) on each of opt0 and llama0."""
    root = tmp_path_factory.mktemp("lora")
    return {(base, i): save_random_lora(checkpoints[base], str(root / f"{base}-{i}"), seed=10 + i, r=r,
                                        use_rslora=(i == 3))
            for base in ("opt0", "llama0") for i, r in enumerate(RANKS)}


def peft_reference(base_path, adapter_dir, prompt, n):
    """transformers + PEFT, the adapter merged into the unsharded base: its greedy continuation."""
    from peft import PeftModel
    model = zoo.load_causal_lm(base_path)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return zoo.reference_generate(model.eval(), prompt, n).tolist()


def configs(checkpoints, adapters):
    out = [ModelConfig(b, zoo.load_causal_lm, {"path": checkpoints[b]}) for b in ("opt0", "llama0")]
    out += [ModelConfig(f"{b}-ft{i}", base=b, adapter=adapters[(b, i)]) for b in ("opt0", "llama0")
            for i in range(len(RANKS))]
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_mixed_adapter_step_matches_hf_peft(checkpoints, adapters, tp, pp):
    refs = {}
    for b in ("opt0", "llama0"):
        refs[b] = peft_reference(checkpoints[b], None, PROMPT, N)
        for i in range(len(RANKS)):
            refs[f"{b}-ft{i}"] = peft_reference(checkpoints[b], adapters[(b, i)], PROMPT, N)
    for b in ("opt0", "llama0"):
        assert len({tuple(refs[m]) for m in refs if m.startswith(b)}) == 1 + len(RANKS), "adapters must matter"

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2, overlap=False, max_loras=4), configs(checkpoints, adapters),
                              tp, pp)
        async with engine:
            assert engine.adapters == {f"{b}-ft{i}": b for b in ("opt0", "llama0") for i in range(len(RANKS))}
            outs = {}
            for b in ("opt0", "llama0"):
                ids = [f"{b}-ft{i}" for i in range(len(RANKS))] + [b]
                got = await asyncio.gather(*[engine.submit(m, {"input_ids": PROMPT, "max_tokens": N}) for m in ids])
                outs.update({m: o.tolist() for m, o in zip(ids, got)})
            steps = [s for s in engine.metrics("step") if s.admitted]
            # sampled with a seed: alone, then sharing its step with three other adapters and the base
            sampled = {"input_ids": PROMPT, "max_tokens": N, "temperature": 1.0, "seed": 7}
            alone = (await engine.submit("opt0-ft1", sampled)).tolist()
            together = await asyncio.gather(engine.submit("opt0-ft1", sampled),
                                            *[engine.submit(m, {"input_ids": PROMPT, "max_tokens": N})
                                              for m in ("opt0-ft0", "opt0-ft2", "opt0-ft3", "opt0")])
            return outs, steps, alone, together[0].tolist()
    outs, steps, alone, together = asyncio.run(go())
    for m, ref in refs.items():
        assert outs[m] == ref, m
    assert max(s.admitted for s in steps) == 1 + len(RANKS)  # the four adapters and the base in one step
    assert alone == together


@pytest.mark.timeout(300)
def test_adapters_added_and_removed_while_serving(checkpoints, adapters):
    ref = peft_reference(checkpoints["opt0"], adapters[("opt0", 2)], PROMPT, N)

    async def go():
        engine = LaunchEngine(EngineConfig(max_loras=2), [ModelConfig("opt0", zoo.load_causal_lm,
                                                                      {"path": checkpoints["opt0"]})], 1, 1)
        async with engine:
            before = await engine.stats_async()
            await engine.add_model(ModelConfig("ft", base="opt0", adapter=adapters[("opt0", 2)]))
            got = (await engine.submit("ft", {"input_ids": PROMPT, "max_tokens": N})).tolist()
            base = (await engine.submit("opt0", {"input_ids": PROMPT, "max_tokens": N})).tolist()
            await engine.remove_model("ft")
            with pytest.raises(UnknownModelError):
                await engine.submit("ft", {"input_ids": PROMPT, "max_tokens": N})
            after = await engine.stats_async()
            return got, base, before, after
    got, base, before, after = asyncio.run(go())
    assert got == ref and base != ref
    assert {r: s.host_bytes for r, s in after.items()} == {r: s.host_bytes for r, s in before.items()}


def test_bad_adapters_fail_alone_with_one_line(checkpoints, adapters, tmp_path):
    from computron.lora.adapter import check_adapter_config
    from computron.lora.adapter import AdapterError
    opt = ModelConfig("opt0", zoo.load_causal_lm, {"path": checkpoints["opt0"]})
    llama_adapter = ModelConfig("x", base="opt0", adapter=adapters[("llama0", 0)])
    with pytest.raises(AdapterError, match="adapter 'x'"):
        check_adapter_config(llama_adapter, opt, 64)
    with pytest.raises(AdapterError, match="adapter 'x'"):
        check_adapter_config(ModelConfig("x", base="opt0", adapter=str(tmp_path / "missing")), opt, 64)
    with pytest.raises(AdapterError, match="rank 16 is over EngineConfig.max_lora_rank=8"):
        check_adapter_config(ModelConfig("x", base="opt0", adapter=adapters[("opt0", 3)]), opt, 8)
