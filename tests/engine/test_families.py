"""Every decoder family of ``family_configs`` through the engine equals the unsharded transformers model.

One engine per layout (TP=1/PP=1, TP=2, PP=2) serves every family's tiny checkpoint at once with two
models resident, so the families swap in and out between tests. A family the engine refuses (its
preflight, or its build on the workers) FAILS here with the engine's message: it is not skipped and
not expected to fail, since the engine is meant to serve every family listed.

Greedy answers are compared with ``model.generate(do_sample=False)`` of the unsharded model, one
prompt at a time. Greedy decoding cannot see a monotonic change of the logits (gemma3's final
soft-capping, granite's ``logits_scaling``), so seeded sampling is also compared with a reference
sampler run on the unsharded model's logits (llama, served today, shows the reference is right).
"""
import asyncio
import zlib
from dataclasses import dataclass, field
from typing import Dict

import psutil
import pytest
import torch
from family_configs import FAMILIES, wide_llama
from helpers import greedy_reference, multiprocessing_servers

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.errors import LaunchError, ModelChangeError
from computron.preflight import PreflightError, check

LAYOUTS = {"tp1pp1": (1, 1), "tp2pp1": (2, 1), "tp1pp2": (1, 2)}
KV_SWAP = {"tp1pp1": "offload", "tp2pp1": "recompute", "tp1pp2": "auto"}  # a paused sequence's KV cache
COMPANIONS = ("opt", "llama", "mistral")  # two of them generate beside each family: 3 models, 2 slots
PROMPT_LENGTHS = (3, 7, 12)
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 120
SAMPLED = dict(temperature=1.0, top_k=0, seed=11)
BATCHING_FAMILIES = ("llama", "qwen3_moe")
SAMPLER_FAMILIES = ("llama", "gemma3_text", "granite")


def _prompts(family: str, lengths=PROMPT_LENGTHS) -> list:
    """Random prompts of ``lengths`` (ids 3..383: below every family's vocabulary, past pad/BOS/EOS),
    seeded by the family name."""
    gen = torch.Generator().manual_seed(zlib.crc32(family.encode()))
    return [torch.randint(3, 384, (n,), generator=gen).tolist() for n in lengths]


def _model_config(name: str, path: str) -> ModelConfig:
    return ModelConfig(name, zoo.load_causal_lm, {"path": path}, checkpoint=path)


_HF: Dict[str, torch.nn.Module] = {}


def _hf(path: str):
    if path not in _HF:
        _HF[path] = zoo.load_causal_lm(path)
    return _HF[path]


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}" + (f" ... {lines[-1].strip()}"
                                                                   if len(lines) > 1 else "")


@dataclass
class Served:
    engine: object
    tp: int
    pp: int
    refused: Dict[str, str] = field(default_factory=dict)

    def require(self, family: str) -> None:
        """Fail (not skip) the test of a family the engine would not serve in this layout."""
        if family in self.refused:
            pytest.fail(f"{family} at tp={self.tp} pp={self.pp}: {self.refused[family]}", pytrace=False)


def _children() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


async def _add_one_by_one(engine, configs, refused) -> None:
    for name, mc in configs.items():
        try:
            await engine.add_model(mc)
        except (ModelChangeError, PreflightError) as exc:
            refused[name] = f"its build failed on the workers: {_first_line(exc)}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Every checkpoint, written before any engine of this module starts: while an engine's master lives
    in a process, torch.distributed is initialised there with a rank other than 0, and transformers'
    ``save_pretrained`` then silently writes nothing."""
    root = str(tmp_path_factory.mktemp("families"))
    return {name: build(root) for name, build in {**FAMILIES, "wide_llama": wide_llama}.items()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, ckpts):
    """One engine of this layout serving every family the preflight accepts (two resident at once, paused
    sequences' KV caches offloaded or recomputed).
    Should the launch of those fail, the engine starts empty and adds them one by one, so that one
    family's failing build fails that family's tests only."""
    tp, pp = LAYOUTS[request.param]
    # turns of 4 steps: a family's sequences are paused between tokens while a companion runs
    config = EngineConfig(max_loaded=2, max_batch_size=8, quantum_ms=1.0, kv_swap=KV_SWAP[request.param])
    configs, refused = {}, {}
    for name in FAMILIES:
        path = ckpts[name]
        mc = _model_config(name, path)
        try:
            check(config, [mc], tp, pp)
        except PreflightError as exc:
            refused[name] = f"refused at launch: {exc}"
        else:
            configs[name] = mc
    before = _children()
    try:
        engine = LaunchEngine(config, list(configs.values()), tp, pp)
    except LaunchError:
        engine = LaunchEngine(config, [], tp, pp)
        asyncio.run(_add_one_by_one(engine, configs, refused))
    try:
        yield Served(engine, tp, pp, refused)
    finally:
        engine.close()
        lasting = multiprocessing_servers()
        left = [psutil.Process(pid) for pid in _children() - before - lasting if psutil.pid_exists(pid)]
        _, alive = psutil.wait_procs(left, timeout=15)
        for p in alive:
            p.kill()
        assert not alive, f"the tp={tp} pp={pp} engine left workers behind: {[p.pid for p in alive]}"


async def _submit_all(engine, family, requests, companions=()):
    """The answers to ``requests`` for ``family``, submitted at once with one request for each of
    ``companions`` (``(model_id, request)``); returns (family's answers, companions' answers)."""
    calls = [engine.submit(family, r, timeout=REQUEST_TIMEOUT_S) for r in requests]
    calls += [engine.submit(m, r, timeout=REQUEST_TIMEOUT_S) for m, r in companions]
    outs = [o.tolist() for o in await asyncio.gather(*calls)]
    return (outs[:len(requests)], outs[len(requests):]) if companions else outs


# ---- TP=16 with fewer KV heads than ranks -------------------------------------------------------------

@pytest.mark.timeout(360)
def test_wide_llama_tp16_matches_hf(ckpts):
    """32 heads and 8 KV heads over 16 TP ranks (2 heads and half a KV head each: KV heads are
    replicated) answer as the unsharded model does. First in the module: no other engine runs beside
    its 16 workers."""
    path = ckpts["wide_llama"]
    prompts = _prompts("wide_llama")
    try:
        engine = LaunchEngine(EngineConfig(max_batch_size=4), [_model_config("wide", path)], 16, 1)
    except LaunchError as exc:
        pytest.fail(f"wide llama (32 heads, 8 KV heads) at tp=16: {_first_line(exc)}", pytrace=False)
    try:
        outs = asyncio.run(_submit_all(engine, "wide", [{"input_ids": p, "max_tokens": MAX_TOKENS} for p in prompts]))
    finally:
        engine.close()
    model = _hf(path)
    for prompt, out in zip(prompts, outs):
        assert out == greedy_reference(model, prompt, MAX_TOKENS).tolist(), f"prompt of {len(prompt)} tokens"


# ---- greedy ------------------------------------------------------------------------------------------

@pytest.mark.timeout(420)  # the first test of a layout also launches its engine (every family built)
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in FAMILIES])
def test_greedy_matches_hf(served, ckpts, family):
    """Three prompts of different lengths batched together (left-padded in the engine) answer as the
    unsharded model does for each prompt alone, while two companion models generate too (three models
    for two slots: the family is swapped in and out between tokens)."""
    served.require(family)
    prompts = _prompts(family)
    companions = [(c, {"input_ids": _prompts(c + "-companion", (5,))[0], "max_tokens": MAX_TOKENS})
                  for c in COMPANIONS if c != family and c not in served.refused][:2]
    outs, companion_outs = asyncio.run(_submit_all(
        served.engine, family, [{"input_ids": p, "max_tokens": MAX_TOKENS} for p in prompts], companions))
    model = _hf(ckpts[family])
    for prompt, out in zip(prompts, outs):
        ref = greedy_reference(model, prompt, MAX_TOKENS).tolist()
        assert out == ref, (f"{family} tp={served.tp} pp={served.pp}, prompt of {len(prompt)} tokens: engine "
                            f"{out} != transformers {ref}")
    for (c, r), out in zip(companions, companion_outs):
        assert out == greedy_reference(_hf(ckpts[c]), r["input_ids"], MAX_TOKENS).tolist(), \
            f"companion {c} beside {family} (tp={served.tp} pp={served.pp})"


def test_references_are_not_degenerate(ckpts):
    """The checkpoints are worth comparing: greedy continuations vary (random weights easily repeat one
    token), and no two families answer alike."""
    seen = {}
    for family, path in ckpts.items():
        refs = [greedy_reference(_hf(path), p, MAX_TOKENS).tolist() for p in _prompts(family)]
        assert all(len(set(r)) >= 3 for r in refs), f"{family}: {refs}"
        seen[family] = refs
    assert len({str(r) for r in seen.values()}) == len(seen)


# ---- seeded sampling ---------------------------------------------------------------------------------

@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in BATCHING_FAMILIES])
def test_seeded_sampling_is_batch_independent(served, family):
    """A seeded sampled request gets the same tokens alone and in a batch with other prompts (other
    lengths, greedy and sampled with other seeds)."""
    served.require(family)
    prompt = _prompts(family, (6,))[0]
    request = {"input_ids": prompt, "max_tokens": MAX_TOKENS, **SAMPLED}
    others = [{"input_ids": p, "max_tokens": MAX_TOKENS + 3} for p in _prompts(family + "-others", (2, 9, 14))]
    others[1].update(temperature=0.7, seed=5)

    async def go():
        alone = (await served.engine.submit(family, request, timeout=REQUEST_TIMEOUT_S)).tolist()
        together = await _submit_all(served.engine, family, [others[0], request, *others[1:]])
        return alone, together[1]
    alone, in_batch = asyncio.run(go())
    assert in_batch == alone, f"{family} tp={served.tp} pp={served.pp}: alone {alone}, in a batch {in_batch}"
    assert len(alone) == MAX_TOKENS or alone[-1] == 2


@torch.inference_mode()
def sampled_reference(model, prompt, max_tokens, temperature, top_k, seed):
    """What the engine's sampler draws on the unsharded model's logits: one ``torch.Generator`` seeded with
    ``seed`` per sequence, one ``multinomial`` over ``softmax(logits / temperature)`` (cut to ``top_k``) per
    token, stopping after EOS (id 2); the argmax at temperature 0."""
    gen = torch.Generator().manual_seed(seed)
    ids, cache, out = torch.tensor([prompt]), None, []
    for _ in range(max_tokens):
        step = model(input_ids=ids, cache=cache, use_cache=True)
        cache = step.cache
        logits = step.logits[:, -1].float()
        if not temperature:
            token = int(logits.argmax(-1))
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        out.append(token)
        if token == 2:
            break
        ids = torch.tensor([[token]])
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in SAMPLER_FAMILIES])
def test_seeded_sampling_matches_hf_logits(served, ckpts, family):
    """Sampled tokens follow the unsharded model's distribution, soft-capping and logit scaling included:
    with one seed, the engine draws what ``sampled_reference`` draws from transformers' logits. (If llama
    fails here too, the engine's sampler changed, not a family.)"""
    served.require(family)
    prompts = _prompts(family + "-sampled", (4, 10))
    requests = [{"input_ids": p, "max_tokens": MAX_TOKENS, **SAMPLED, "seed": 100 + i} for i, p in enumerate(prompts)]
    outs = asyncio.run(_submit_all(served.engine, family, requests))
    model = _hf(ckpts[family])
    for r, out in zip(requests, outs):
        ref = sampled_reference(model, r["input_ids"], MAX_TOKENS, r["temperature"], r["top_k"], r["seed"])
        assert out == ref, f"{family} tp={served.tp} pp={served.pp}, seed {r['seed']}: engine {out} != reference {ref}"


def test_sampled_reference_is_generate_when_greedy(ckpts):
    """The reference sampler's model loop (cache, positions, sliding windows) is transformers' own: at
    temperature 0 it picks generate's greedy tokens."""
    for family in SAMPLER_FAMILIES + BATCHING_FAMILIES:
        model, prompt = _hf(ckpts[family]), _prompts(family)[2]
        assert sampled_reference(model, prompt, MAX_TOKENS, 0, 0, 0) == \
            greedy_reference(model, prompt, MAX_TOKENS).tolist(), family


# ---- a prompt joining running sequences --------------------------------------------------------------

@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in ("mistral", "gemma3_text", "llama")])
def test_prompt_joining_a_running_sequence_matches_hf(served, ckpts, family):
    """A long prompt arrives while a short one is generating (it joins the running batch between steps):
    both answer as the unsharded model does. Sliding-window families (mistral, gemma3_text) count the keys
    in their window, so the joining prefill must leave no masked columns among a running row's latest keys."""
    served.require(family)
    first, joining = _prompts(family + "-join", (3, 10))
    engine, got = served.engine, {}

    async def go():
        started = asyncio.Event()

        async def running():
            toks = []
            async for t in engine.stream(family, {"input_ids": first, "max_tokens": MAX_TOKENS + 2},
                                         timeout=REQUEST_TIMEOUT_S):
                toks.append(int(t))
                if len(toks) == 5:
                    started.set()
            started.set()
            got["first"] = toks

        async def joins():
            await started.wait()
            got["joining"] = (await engine.submit(family, {"input_ids": joining, "max_tokens": MAX_TOKENS},
                                                  timeout=REQUEST_TIMEOUT_S)).tolist()
        await asyncio.gather(running(), joins())
    asyncio.run(go())
    model = _hf(ckpts[family])
    assert got["first"] == greedy_reference(model, first, MAX_TOKENS + 2).tolist(), f"{family}: the running one"
    assert got["joining"] == greedy_reference(model, joining, MAX_TOKENS).tolist(), f"{family}: the joining one"
