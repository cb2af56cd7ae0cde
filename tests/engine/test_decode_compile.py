"""``EngineConfig.compile_decode='on'`` on a CPU (inductor): a causal LM's runner, built in this process as a
worker builds it, serves sequences joining and leaving at different steps (so the decode batch changes size
and the keys' width grows) through its compiled decode step, and every sequence's greedy tokens equal
transformers' ``generate`` of its prompt alone, the Linears running on their packed weights inside the compiled
step; a CPU offload keeps the compiled forward and removing the model drops it.
One rank (a "fake" process group of one: no collective runs), each KV layout, the pool's decode attention
gathered for SDPA or read in place (``cpu_attention``'s operator inside the compiled step)."""
import pytest
import torch
import torch.distributed as dist

from computron import ModelConfig
from computron.comm import messages as msg
from computron.comm.topology import Layout
from computron.models import StageContext, make_runner
from computron.models import decode_compile
from computron.testing.zoo import random_causal_lm, reference_generate

pytestmark = pytest.mark.timeout(600)

PROMPTS = {0: [[5, 9, 13, 17, 21], [40, 41]], 2: [list(range(30, 42))], 3: [[7, 8, 9]]}
"""Step -> prompts joining then."""
MAX_TOKENS = (6, 3, 5, 4)


class OneRank:
    """What a runner reads of ``topology.Groups`` at TP=PP=1."""

    layout = Layout(1, 1, 1, False)
    rank, stage, tp_rank, tp_group, data = 0, 0, 0, None, None


def _inductor_works() -> bool:
    try:
        return torch.compile(lambda t: t * 2 + 1)(torch.ones(3)).sum().item() == 9.0
    except Exception:  # noqa: BLE001 - no C++ compiler, or an inductor that cannot build here
        return False


@pytest.fixture(scope="module")
def one_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not _inductor_works():
        pytest.skip("torch.compile's inductor cannot build a kernel on this machine (no working C++ compiler)")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(before)


def _serve(runner):
    """Every sequence's tokens, driving ``runner.step`` as the master does: joins at PROMPTS' steps."""
    out, sid, step, running = {}, 0, 0, 0
    while step <= max(PROMPTS) or running:
        admit = []
        for p in PROMPTS.get(step, []):
            admit.append(msg.SeqSpec(sid=sid, prompt=tuple(p), max_tokens=MAX_TOKENS[sid]))
            out[sid] = (p, [])
            sid += 1
        res = runner.step(msg.Step(seq=step, model_id="m", admit=tuple(admit)), lambda: None)
        for s, t in zip(res.sids, res.tokens):
            out[s][1].append(t)
        running, step = res.running, step + 1
    return out


@pytest.mark.parametrize("kv_cache,direct", [("dynamic", False), ("paged", True), ("paged", False)])
def test_compiled_decode_equals_generate_and_is_released(one_group, kv_cache, direct, monkeypatch):
    from computron.kernels.cpu import attention as cpu_attention
    from computron.kernels.cpu import linear as cpu_linear
    monkeypatch.setattr(cpu_linear, "PACK_MIN", 0)  # llama-tiny's Linears packed too, as a real model's are
    model = random_causal_lm("llama-tiny", seed=0)
    ctx = StageContext(OneRank(), torch.device("cpu"), "m", scatter_from=None, kv_cache=kv_cache,
                       kv_block_size=4, compile_decode="on", cpu_attention=direct)
    runner = make_runner(random_causal_lm("llama-tiny", seed=0), ModelConfig("m", random_causal_lm,
                                                                              {"name": "llama-tiny"}), ctx)
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _serve(runner)
    ops = {e.key for e in prof.key_averages()}
    assert runner.decode.enabled and not runner.decode.failed, "compiled on, and no fallback to eager"
    assert runner.decode.active and runner.decode.compiles == 1, "compiled once, lazily, and held"
    op = {cpu_linear.BLOCKED: "computron::block_linear", cpu_linear.ONEDNN: "computron::packed_linear"}
    packs = cpu_linear.packing_available() or cpu_linear.gemm.available()
    assert not packs or op[cpu_linear.pack_kind()] in ops, \
        "the compiled step runs the Linears on the packs (one opaque operator each)"
    in_place = direct and cpu_attention.available()
    assert getattr(runner.running, "cache", None) is None or (runner.running.cache.backend == "cpu_paged") == in_place
    assert ("computron::paged_decode" in ops) == in_place, "the pool's attention kernel: one opaque operator"
    for sid, (prompt, toks) in got.items():
        want = reference_generate(model, prompt, MAX_TOKENS[sid]).tolist()
        assert toks == want, f"{kv_cache}, sequence {sid}: compiled {toks} != generate {want}"
    runner.release_resident()
    assert runner.decode.active and not runner.decode.warmed, "a CPU offload keeps the compiled code"
    other = random_causal_lm("llama-tiny", seed=1)  # the next residency: other weights in new buffers
    with torch.no_grad():
        for mine, theirs in zip(runner.module.parameters(), other.parameters()):
            mine.data = theirs.data.clone()
    runner.forget_prefixes()  # cached prompt blocks were computed with the first weights
    with torch.inference_mode():
        again = _serve(runner)
    assert runner.decode.compiles == 1, "the kept code served the next residency"
    for sid, (prompt, toks) in again.items():
        assert toks == reference_generate(other, prompt, MAX_TOKENS[sid]).tolist(), f"{kv_cache}, after a swap"
    runner.drop_all()
    assert not runner.decode.active and not decode_compile.REGISTRY.live, "removing the model drops it"
