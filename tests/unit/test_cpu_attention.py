"""The CPU paged decode attention kernel equals gathered SDPA (GQA ratios, head sizes, sliding windows,
scattered slots), and a machine without a compiler falls back with one warning."""
import pytest
import torch

from computron.models import attention
from computron.kernels.cpu import attention as cpu_attention

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the CPU kernel")


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 24), (2, 1, 7)])
@pytest.mark.parametrize("window", [0, 3])
def test_kernel_equals_gathered_sdpa(heads, kv_heads, dim, window):
    gen = torch.Generator().manual_seed(heads * 100 + dim + window)
    slots_n, lengths = 128, torch.tensor([1, 5, 30, 12])
    pool_k, pool_v = (torch.randn(kv_heads, slots_n, dim, generator=gen) for _ in range(2))
    slots = torch.randperm(slots_n, generator=gen)[:4 * 30].view(4, 30)
    query = torch.randn(4, heads, 1, dim, generator=gen)
    got = cpu_attention.decode(query, pool_k, pool_v, slots, lengths, 0.3, window)
    want = cpu_attention.reference(query, pool_k, pool_v, slots, lengths, 0.3, window)
    assert got.shape == (4, 1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_query_laid_out_as_the_attention_layers_give_it():
    """[B, 1, H, D] transposed to [B, H, 1, D] (not contiguous in general), as transformers' layers pass it."""
    gen = torch.Generator().manual_seed(7)
    pool_k, pool_v = (torch.randn(2, 40, 32, generator=gen) for _ in range(2))
    slots, lengths = torch.arange(40).view(2, 20), torch.tensor([20, 9])
    query = torch.randn(2, 1, 6, 32, generator=gen).transpose(1, 2)
    torch.testing.assert_close(cpu_attention.decode(query, pool_k, pool_v, slots, lengths, 0.2),
                               cpu_attention.reference(query, pool_k, pool_v, slots, lengths, 0.2))


def test_no_compiler_means_unavailable_one_warning_and_no_direct_path(monkeypatch, tmp_path, caplog):
    from computron.kernels.cpu import build as cpu_kernels
    from transformers import LlamaConfig
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    cpu_attention._kernel.cache_clear()
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    config._attn_implementation = "sdpa"
    try:
        with caplog.at_level("WARNING", logger=cpu_attention.__name__):
            assert not cpu_attention.available() and not cpu_attention.available()
            assert not attention.direct_fits(config, torch.device("cpu"))
        warned = [r for r in caplog.records if "paged decode attention kernel is not used" in r.getMessage()]
        assert len(warned) == 1
    finally:
        cpu_attention._kernel.cache_clear()


@needs_kernel
def test_direct_fits_names_its_conditions(monkeypatch):
    from transformers import GPTNeoXConfig, LlamaConfig
    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    llama._attn_implementation = "sdpa"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert attention.direct_fits(llama, torch.device("cpu"))
    assert not attention.direct_fits(llama, torch.device("cpu"), enabled=False)
    assert not attention.direct_fits(llama, torch.device("cuda"))
    neox = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    neox._attn_implementation = "sdpa"
    assert not attention.direct_fits(neox, torch.device("cpu"))  # not in DIRECT_FAMILIES
    llama._attn_implementation = "eager"
    assert not attention.direct_fits(llama, torch.device("cpu"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    llama._attn_implementation = "sdpa"
    assert not attention.direct_fits(llama, torch.device("cpu"))  # the kernel is single-threaded
