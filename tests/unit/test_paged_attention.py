"""The ``paged`` attention backend (``models/paged_attention.py``: FlexAttention over the pool in place)
equals attention over each sequence's keys gathered out of the pool: decode batches, prompts, mixed steps of
sequences of different lengths in one ragged row, GQA, sliding windows, soft-capping; and served through a
model it gives ``generate``'s tokens (``models/attention.py`` installs it)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/unit: the paged serving harness

from test_paged_batch import MAX_TOKENS, _model, _serve  # noqa: E402

from computron import EngineConfig  # noqa: E402
from computron.models import attention  # noqa: E402
from computron.models.paged_attention import build  # noqa: E402
from computron.testing.zoo import reference_generate  # noqa: E402

pytestmark = pytest.mark.unit

BS = 4


def _tables(lengths, num_blocks, gen):
    """Scattered physical blocks for each sequence of these lengths (a pool of ``num_blocks``)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lengths:
        k = -(-n // BS)
        tables.append(perm[at:at + k])
        at += k
    return tables


def _reference(q_rows, pool_k, pool_v, tables, lengths, counts, scale, window, softcap):
    """Each row's queries [H, n, D] against its own keys gathered from the pool, causal (and windowed)."""
    out = []
    heads, kv_heads = q_rows[0].shape[0], pool_k.shape[0]
    for q, table, n, c in zip(q_rows, tables, lengths, counts):
        slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])
        k = pool_k.index_select(1, slots).repeat_interleave(heads // kv_heads, 0)
        v = pool_v.index_select(1, slots).repeat_interleave(heads // kv_heads, 0)
        scores = q @ k.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qp, kp = torch.arange(n - c, n)[:, None], torch.arange(n)[None]
        ok = (kp <= qp) & ((qp - kp < window) if window else True)
        out.append(scores.masked_fill(~ok, float("-inf")).softmax(-1) @ v)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 16), (4, 4, 32)])
@pytest.mark.parametrize("window,softcap", [(0, None), (5, None), (0, 2.0)])
@pytest.mark.parametrize("step", ["decode", "prefill", "mixed"])
def test_paged_equals_gathered(heads, kv_heads, dim, window, softcap, step):
    gen = torch.Generator().manual_seed(heads + dim + window + len(step))
    lengths, counts = {"decode": ([9, 1, 30, 16, 5], [1] * 5), "prefill": ([70], [70]),
                       "mixed": ([9, 30, 70, 12, 3, 100], [1, 1, 70, 5, 3, 1])}[step]
    num_blocks = 80
    tables = _tables(lengths, num_blocks, gen)
    pool_k, pool_v = (torch.randn(kv_heads, num_blocks * BS, dim, generator=gen) for _ in range(2))
    batched = step == "decode"
    ps = build(counts, lengths, tables, num_blocks, BS, [window], batched, torch.device("cpu"))
    ps.window_of = lambda layer: window
    q_rows = [torch.randn(heads, c, dim, generator=gen) for c in counts]
    query = torch.stack(q_rows) if batched else torch.cat(q_rows, 1)[None]   # [B, H, 1, D] or [1, H, T, D]
    got = ps.attend(0, query, pool_k[None], pool_v[None], 0.3, softcap)
    want = _reference(q_rows, pool_k, pool_v, tables, lengths, counts, 0.3, window, softcap)
    want = torch.stack(want).transpose(1, 2) if batched else torch.cat(want, 1).transpose(0, 1)[None]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_without_queries_and_a_shared_prefix_block():
    """A chunk the prefix cache held computes nothing (count 0); two sequences share their first block."""
    gen = torch.Generator().manual_seed(3)
    lengths, counts = [8, 10, 6], [3, 0, 2]
    tables = [[5, 2], [5, 7, 1], [9, 4]]
    pool_k, pool_v = (torch.randn(2, 10 * BS, 16, generator=gen) for _ in range(2))
    ps = build(counts, lengths, tables, 10, BS, [0], False, torch.device("cpu"))
    q_rows = [torch.randn(4, c, 16, generator=gen) for c in counts]
    got = ps.attend(0, torch.cat(q_rows, 1)[None], pool_k[None], pool_v[None], 0.25)
    want = _reference(q_rows, pool_k, pool_v, tables, lengths, counts, 0.25, 0, None)
    torch.testing.assert_close(got, torch.cat(want, 1).transpose(0, 1)[None], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3", "phi3"])
def test_paged_backend_serves_generates_tokens(family, tmp_path):
    """Joins, leaves, a park and a pool growth (``test_paged_batch``'s schedule) through ``paged``."""
    model = _model(family, tmp_path)
    produced, _ = _serve(model, block_size=4, stop_early=1, backend="paged")
    assert model.config._attn_implementation == attention.NAMES["paged"]
    for sid, (prompt, tokens) in produced.items():
        want = reference_generate(model, prompt, MAX_TOKENS).tolist()
        assert tokens[:len(want)] == (want[:2] if sid == 1 else want), f"{family}: sequence {sid}"


def test_backend_choice_and_errors(monkeypatch):
    from transformers import GPTNeoXConfig, LlamaConfig
    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    llama._attn_implementation = "sdpa"
    neox = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention.choose("auto", llama, cuda) == "paged"
    assert attention.choose("auto", neox, cuda) == "gathered"
    assert attention.choose("paged", llama, cpu) == "paged"
    assert attention.choose("gathered", neox, cpu) == "gathered"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert attention.choose("auto", llama, cpu) == "gathered"
    with pytest.raises(ValueError, match="does not serve model type 'gpt_neox'"):
        attention.choose("paged", neox, cpu)
    with pytest.raises(ValueError, match="cpu_paged' needs a CPU worker on one intra-op thread"):
        attention.choose("cpu_paged", llama, cpu)
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        attention.choose("flash", llama, cpu)
    with pytest.raises(ValueError, match="EngineConfig.attention_backend='flash'"):
        EngineConfig(attention_backend="flash")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_forward_without_a_paged_step_runs_the_original_attention(impl):
    """A request-level batch (transformers' DynamicCache, no ``paged_step``) through an installed model runs
    its original implementation, mask included; installing twice changes nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=64)
    config._attn_implementation = impl
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 6, 7, 8]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        want = model(ids, attention_mask=mask).logits
        attention.install(model, "paged")
        attention.install(model, "paged")
        got = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == attention.NAMES["paged"] + ("" if impl == "sdpa" else "_eager")
    torch.testing.assert_close(got, want)
