"""The paged KV pool (``models/kv_pool.py``, ``models/paged_running.py``) driven on unsharded transformers
models in process: prompts of mixed lengths join running sequences in one ragged row, sequences leave,
the pool grows, parks and comes back, and every sequence's greedy tokens equal transformers' ``generate``
of its prompt alone, for every decoder family of ``tests/family_configs.py`` (sliding windows, mixed layer
types, soft-capping, fused projections, experts)."""
from __future__ import annotations

import inspect
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: family_configs

from family_configs import FAMILIES  # noqa: E402

from computron.models import attention  # noqa: E402
from computron.kernels.cpu import attention as cpu_attention  # noqa: E402
from computron.models.paged_running import PagedBatch  # noqa: E402
from computron.testing.zoo import reference_generate  # noqa: E402

pytestmark = pytest.mark.unit

# step -> prompts admitted at that step: a long prompt joins short running ones, several join at once
ADMISSIONS = {0: [[5, 9, 13, 17, 21]], 2: [list(range(30, 42)), [7, 8, 9]], 3: [list(range(40, 60))],
              5: [[11, 12]]}
MAX_TOKENS = 6
PARK_AT = 4  # the running sequences' KV blocks copied out (as from a device) after this step, back before the next


def _forward(model, ids, mask, cache) -> torch.Tensor:
    kw = "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"
    hidden = model.base_model(input_ids=ids, attention_mask=mask, position_ids=cache.position_ids, use_cache=True,
                              **{kw: cache}, **cache.forward_kwargs()).last_hidden_state
    last = hidden[:, -1] if cache.last_index is None else hidden[0, cache.last_index]  # decode batch, ragged row
    return model.get_output_embeddings()(last).float()


def _serve(model, block_size: int, stop_early=None, pow2: bool = False, backend: str = "gathered") -> dict:
    rb, produced, sid, parked = PagedBatch(model.config, block_size=block_size, initial_blocks=2), {}, 0, []
    rb.cache.pow2_width = pow2
    attention.install(model, backend)
    rb.cache.backend = backend
    widths = set()
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
            rb.unpark(torch.device("cpu"))
            ids, mask, _ = rb.step_inputs(prompts, [s.sid for s in specs], torch.device("cpu"), torch.float32)
            tokens = _forward(model, ids, mask, rb.cache).argmax(-1)
            if rb.cache.batched and rb.cache._shape is not None:  # a gathered decode batch's width
                widths.add(rb.cache._shape[1])
            rb.joined(specs, {}, mask, tokens)
            for s, t in zip(rb.sids, tokens.tolist()):
                produced[s][1].append(t)
            rb.drop(rb.ended([stop_early is not None and s == stop_early and len(produced[s][1]) == 2
                              for s in rb.sids]))
            if step == PARK_AT:
                used = rb.cache.tables.used_blocks
                parked.append((rb.park(copy=True), used * rb.cache.block_bytes(), rb.kv_bytes(),
                               rb.cache.tables.used_tokens))
    assert not len(rb) and rb.cache.tables.used_blocks == 0
    assert not pow2 or widths <= {16, 32, 64}, widths
    return produced, parked


def _model(family, root):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(FAMILIES[family](root)).eval()
    model.generation_config.eos_token_id = None  # every sequence runs its MAX_TOKENS
    return model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if f != "wide_llama"))
def test_paged_ragged_steps_equal_generate(family, root):
    model = _model(family, root)
    produced, parked = _serve(model, block_size=4, stop_early=1)
    assert len(produced) == sum(len(p) for p in ADMISSIONS.values())
    for sid, (prompt, tokens) in produced.items():
        want = reference_generate(model, prompt, MAX_TOKENS).tolist()  # up to its first EOS (id 2)
        assert tokens[:len(want)] == (want[:2] if sid == 1 else want), f"{family}: sequence {sid}"
    (moved, in_use, kv, tokens), = parked
    assert moved == in_use > 0  # a park copies the blocks in use, nothing else
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4  # the model's formula (float32)
    assert tokens > 0 and kv == tokens * per_token  # the pool accounts each token as the formula says


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_power_of_two_decode_widths_equal_generate(family, root):
    """``PagedKV.pow2_width`` (a CUDA-graphed decode step's few shapes): the padded columns are masked."""
    model = _model(family, root)
    produced, _ = _serve(model, block_size=4, pow2=True)
    for sid, (prompt, tokens) in produced.items():
        want = reference_generate(model, prompt, MAX_TOKENS).tolist()
        assert tokens[:len(want)] == want, f"{family}: sequence {sid}"


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("family", sorted(set(FAMILIES) & attention.DIRECT_FAMILIES))
def test_decode_attention_from_the_pool_in_place_equals_generate(family, root, monkeypatch):
    """The ``cpu_paged`` backend (``cpu_attention``): every decode step's attention read from the pool by
    the kernel, none by the model's SDPA over gathered keys, the tokens those of ``generate``."""
    model = _model(family, root)
    model.config._attn_implementation = "sdpa"
    calls, run = [], cpu_attention._run
    monkeypatch.setattr(cpu_attention, "_run", lambda *a: calls.append(a[1].shape) or run(*a))
    produced, _ = _serve(model, block_size=4, stop_early=1, backend="cpu_paged")
    assert len(calls) >= model.config.num_hidden_layers * MAX_TOKENS  # each layer of every decode step
    for sid, (prompt, tokens) in produced.items():
        want = reference_generate(model, prompt, MAX_TOKENS).tolist()
        assert tokens[:len(want)] == (want[:2] if sid == 1 else want), f"{family}: sequence {sid}"


def test_initial_blocks_follow_the_kv_formula():
    from computron.models.kv_pool import initial_blocks
    cfg = SimpleNamespace(num_key_value_heads=2, num_attention_heads=4, hidden_size=64, head_dim=None,
                          dtype="bfloat16")
    # per block: 2 (K, V) x 1 KV head (2 over TP=2) x 16 dims x 2 bytes x 2 layers x 4 tokens = 512 bytes
    assert initial_blocks(cfg, tp=2, layers=2, block_size=4, budget_bytes=10_000) == 19
    assert initial_blocks(cfg, tp=2, layers=2, block_size=4, budget_bytes=5_000) == 16  # the floor


def test_chunked_prefill_rows_and_a_filling_sequence_dropped_frees_its_blocks():
    """``PagedBatch.pieces``: a prompt prefilled over steps holds blocks but no row until it is complete."""
    rb = PagedBatch(SimpleNamespace(), block_size=4, initial_blocks=2)
    long = SimpleNamespace(sid=1, prompt=tuple(range(10)), chunk=4, max_tokens=3)
    short = SimpleNamespace(sid=2, prompt=(5, 6), chunk=0, max_tokens=3)
    specs, ends, complete, rows = rb.pieces([long, short], ())
    assert ends == [4, 2] and complete == [short] and rows == [1]
    ids, _, _ = rb.step_inputs([list(s.prompt) for s in specs], [s.sid for s in specs], torch.device("cpu"),
                               torch.float32, ends=ends)
    assert ids.tolist() == [[0, 1, 2, 3, 5, 6]]
    assert rb.cache.tables.lengths == {1: 4, 2: 2} and rb.cache.last_index.tolist() == [3, 5]
    rb.joined(complete, {}, None, torch.tensor([9]))
    assert rb.sids == [2] and set(rb.filling) == {1}
    specs, ends, complete, rows = rb.pieces([], [(1, 5)])
    assert ends == [9] and complete == [] and rb.filling[1][1] == 9
    ids, _, _ = rb.step_inputs([list(long.prompt)], [1], torch.device("cpu"), torch.float32, ends=ends)
    assert ids.tolist() == [[9] + list(range(4, 9))] and rb.prefilled == 5
    assert rb.cache.tables.lengths[1] == 9 and rb.cache.position_ids.tolist() == [[2] + list(range(4, 9))]
    rb.drop([1])
    assert rb.filling == {} and 1 not in rb.cache.tables.lengths and rb.sids == [2]


def test_a_chunk_inside_a_cached_prefix_computes_nothing_and_the_prompt_ends_as_a_full_prefill(root):
    """Chunked prefill with the prefix cache: a first chunk ending inside the cached prefix computes no
    token, the last chunk only what the cache lacks, and its logits equal the first prompt's."""
    model = _model("llama", root)
    prompt = list(range(50, 63))  # 13 tokens: three full blocks of 4 cached by the first sequence
    rb = PagedBatch(model.config, block_size=4, initial_blocks=2)
    cpu = torch.device("cpu")
    first = SimpleNamespace(sid=0, prompt=tuple(prompt), chunk=0, max_tokens=MAX_TOKENS)
    again = SimpleNamespace(sid=1, prompt=tuple(prompt), chunk=4, max_tokens=MAX_TOKENS)
    with torch.inference_mode():
        specs, ends, complete, _ = rb.pieces([first], ())
        ids, mask, _ = rb.step_inputs([prompt], [0], cpu, torch.float32, ends=ends)
        want = _forward(model, ids, mask, rb.cache)
        rb.joined(complete, {}, mask, want.argmax(-1))
        specs, ends, complete, _ = rb.pieces([again], ())
        ids, mask, _ = rb.step_inputs([prompt], [1], cpu, torch.float32, ends=ends)
        assert rb.prefilled == 0 and rb.cache.counts == [1, 0] and rb.cache.tables.lengths[1] == 12
        rb.joined(complete, {}, mask, _forward(model, ids, mask, rb.cache)[:1].argmax(-1))
        specs, ends, complete, rows = rb.pieces([], [(1, 9)])
        assert ends == [13] and complete == [again]
        ids, mask, _ = rb.step_inputs([prompt], [1], cpu, torch.float32, ends=ends)
        assert rb.prefilled == 1 and ids.tolist() == [[rb.last[0].item()], [prompt[-1]]]  # a decode batch
        got = _forward(model, ids, mask, rb.cache)
    torch.testing.assert_close(got[1:], want, rtol=1e-4, atol=1e-4)


SYSTEM = list(range(50, 60))  # a shared "system prompt" of 10 tokens: two full blocks of 4, and 2 tokens more
CACHED = {0: [SYSTEM + [3]], 1: [SYSTEM + [4, 5, 6], SYSTEM + [4, 5, 6]], 2: [SYSTEM + [4, 5, 6]]}
"""step -> prompts joining: the second step's first prompt starts with the first's two full blocks, its copy
(an n > 1 request) with all three of its own full blocks, written in that same forward; the third step's
prompt has one token to compute, so its step is a decode batch."""


def _serve_cached(model, prefix_cache: bool):
    rb = PagedBatch(model.config, block_size=4, initial_blocks=2, prefix_cache=prefix_cache)
    logits, produced, prefilled, sid = [], {}, [], 0
    with torch.inference_mode():
        for step in range(max(CACHED) + MAX_TOKENS):
            prompts = CACHED.get(step, [])
            if not len(rb) and not prompts:
                break
            specs = [SimpleNamespace(sid=sid + i, max_tokens=MAX_TOKENS) for i in range(len(prompts))]
            for s, p in zip(specs, prompts):
                produced[s.sid] = (p, [])
            sid += len(prompts)
            ids, mask, _ = rb.step_inputs(prompts, [s.sid for s in specs], torch.device("cpu"), torch.float32)
            prefilled.append(rb.prefilled)
            out = _forward(model, ids, mask, rb.cache)
            logits.append(out)
            tokens = out.argmax(-1)
            rb.joined(specs, {}, mask, tokens)
            for s, t in zip(rb.sids, tokens.tolist()):
                produced[s][1].append(t)
            rb.drop(rb.ended([False] * len(rb)))
    assert not len(rb) and rb.cache.tables.used_blocks == 0
    return logits, produced, prefilled, rb


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_cached_prefix_gives_the_logits_of_a_full_prefill(family, root):
    model = _model(family, root)
    plain, plain_out, plain_pre, _ = _serve_cached(model, prefix_cache=False)
    cached, cached_out, cached_pre, rb = _serve_cached(model, prefix_cache=True)
    assert plain_pre[:3] == [11, 26, 13]
    assert cached_pre[:3] == [11, 13 - 8 + 1, 1]   # 8 tokens from the first prompt, then 12 from the second's
    assert len(plain) == len(cached)
    for a, b in zip(plain, cached):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert cached_out == plain_out
    for sid, (prompt, tokens) in cached_out.items():
        want = reference_generate(model, prompt, MAX_TOKENS).tolist()  # up to its first EOS (id 2)
        assert tokens[:len(want)] == want, f"{family}: sequence {sid}"
    assert rb.cache.tables.cached_blocks > 0 and rb.cache.tables.free_blocks == rb.cache.tables.num_blocks


@pytest.mark.parametrize("on", [True, False])
def test_prefix_cache_setting_is_validated_and_reaches_the_pool(on):
    from computron import EngineConfig
    from computron.models.causal_lm import _running_batch
    assert EngineConfig().prefix_cache is True and EngineConfig(prefix_cache=on).prefix_cache is on
    with pytest.raises(ValueError, match="prefix_cache='yes'"):
        EngineConfig(prefix_cache="yes")
    ctx = SimpleNamespace(kv_cache="paged", kv_block_size=4, tp=1, kv_reserve=0.1, prefix_cache=on,
                          device=torch.device("cpu"), cpu_attention=False, attention_backend="auto")
    config = SimpleNamespace(num_key_value_heads=2, num_attention_heads=2, hidden_size=8, head_dim=None)
    assert _running_batch(config, ctx, torch.nn.Linear(8, 8), 1).prefix_cache is on
