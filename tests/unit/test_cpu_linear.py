"""CPU Linears (``kernels/cpu/linear.py``): the packed and the weight-first products equal ``F.linear`` to float
rounding in every shape they take, ``linear`` picks them only where its rules say, a packed weight is made
once per load and again when the weight changes, and the class swap keeps the modules, their hooks and what
they compute."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from computron.kernels.cpu import linear as cpu_linear
from computron.kernels.cpu.linear import (FewRowLinear, linear, packed_bytes, packing_available, release_packs,
                                          use_cpu_kernels, weight_first)


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for one test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [2, 3, 8, 64])
def test_weight_first_equals_f_linear_and_is_contiguous(rows, bias):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 48), torch.randn(96, 48)
    b = torch.randn(96) if bias else None
    out = weight_first(x, w, b)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_computes_few_rows_weight_first_with_several_threads(threads, monkeypatch):
    threads(2)
    used = []
    monkeypatch.setattr(cpu_linear, "weight_first", lambda *a: used.append(a[0].shape) or F.linear(*a))
    w, b = torch.randn(32, 16), torch.randn(32)
    for shape in [(1, 16), (2, 16), (3, 5, 16), (64, 16), (65, 16), (16,), (2, 40, 16)]:
        x = torch.randn(*shape)
        out = linear(x, w, b)
        assert out.shape == (*shape[:-1], 32)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # 1 row (a matrix-vector product either way), over MAX_ROWS rows and 1-D inputs keep F.linear
    assert used == [(2, 16), (15, 16), (64, 16)]


def test_linear_is_f_linear_with_one_thread_or_mixed_dtypes(threads, monkeypatch):
    monkeypatch.setattr(cpu_linear, "weight_first", lambda *a: pytest.fail("weight-first was picked"))
    w = torch.randn(32, 16)
    threads(1)
    x = torch.randn(8, 16)
    assert torch.equal(linear(x, w), F.linear(x, w))
    threads(2)
    with pytest.raises(RuntimeError):  # F.linear's own error for mismatched dtypes
        linear(torch.randn(8, 16, dtype=torch.float64), w)


def test_swap_keeps_modules_hooks_and_outputs_and_skips_subclasses(threads):
    threads(2)
    torch.manual_seed(0)

    class Custom(nn.Linear):
        pass

    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), Custom(16, 4))
    seen = []
    net[2].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    first, x = net[0], torch.randn(4, 16)
    with torch.no_grad():
        want = net(x)
    assert use_cpu_kernels(net, pack=False) == 2
    assert not any(getattr(m, "pack_weights", False) for m in net.modules())
    assert net[0] is first and type(net[0]) is FewRowLinear and type(net[2]) is FewRowLinear
    assert type(net[3]) is Custom
    with torch.no_grad():
        torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
    assert seen == [(4, 16), (4, 16)]
    assert isinstance(net[0], nn.Linear) and net[0].weight is first.weight


class OneRank:
    """What a TP=1, PP=1 runner reads of ``topology.Groups``."""

    def __init__(self):
        from computron.comm.topology import Layout
        self.layout, self.rank, self.tp_group = Layout(1, 1, 1, False), 0, None

    stage = property(lambda self: 0)
    tp_rank = property(lambda self: 0)


@pytest.fixture
def pack_any_size(monkeypatch):
    """Pack the small weights of these tests too (the engine packs from ``PACK_MIN`` elements)."""
    from computron.kernels.cpu import linear as cpu_linear
    monkeypatch.setattr(cpu_linear, "PACK_MIN", 0)


def test_a_cpu_runner_swaps_its_linears_and_generates_what_plain_linears_do(threads, tmp_path, pack_any_size):
    """``make_runner`` on a CPU device swaps the model's Linears to packed ones; greedy generation of a padded
    batch (a prefill of 4 x 6 rows, decode steps of 4) with two threads gives the plain model's tokens, and
    ``release_resident`` (the model leaves) drops every packed weight."""
    from computron import ModelConfig, zoo
    from computron.models import StageContext, make_runner
    threads(2)
    path = zoo.save_random_causal_lm("opt-tiny", str(tmp_path / "m"), seed=3)
    ids = torch.tensor([[1, 1, 5, 17, 42, 99], [300, 12, 8, 9, 10, 11], [1, 1, 1, 77, 66, 55], [2, 401, 3, 250, 18, 7]])
    mask = (torch.arange(6)[None, :] >= torch.tensor([[2], [0], [3], [0]])).long()
    plain = zoo.load_causal_lm(path).eval()
    with torch.no_grad():
        want = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1)

    model = zoo.load_causal_lm(path).eval()
    ctx = StageContext(OneRank(), torch.device("cpu"), "m", scatter_from=None)
    runner = make_runner(model, ModelConfig("m", zoo.load_causal_lm, {"path": path}), ctx)
    linears = [m for m in runner.module.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FewRowLinear for m in linears)
    assert all(m.pack_weights == packing_available() for m in linears)
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1)
    assert torch.equal(got, want)
    held = packed_bytes(runner.module)
    assert held == (sum(m.weight.numel() * 4 for m in linears) if packing_available() else 0)
    assert runner.release_resident() == held and packed_bytes(runner.module) == 0


needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed Linear")


def _packed_linear(out_f, in_f, bias=True):
    lin = nn.Linear(in_f, out_f, bias=bias)
    use_cpu_kernels(lin, pack=True)
    return lin


@needs_onednn
@pytest.mark.parametrize("n_threads", [1, 2])  # one thread: cpu_gemm's blocks where it builds; two: oneDNN's
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (9, 48), (100, 48), (3, 5, 48), (0, 48)])
def test_packed_equals_f_linear_in_every_shape(shape, bias, n_threads, threads, pack_any_size):
    threads(n_threads)
    torch.manual_seed(len(shape) + shape[0])
    lin, x = _packed_linear(96, 48, bias), torch.randn(*shape)
    with torch.no_grad():
        out = lin(x)
        assert packed_bytes(lin) == 96 * 48 * 4
        assert lin.packed_kind == cpu_linear.pack_kind()
        assert (lin.packed_kind == cpu_linear.BLOCKED) == (n_threads == 1 and cpu_linear.gemm.available())
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        strided = torch.randn(shape[0], 96)[:, ::2]  # a non-contiguous input
        torch.testing.assert_close(lin(strided), F.linear(strided, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_pack_is_made_once_and_again_when_the_weight_changes(pack_any_size):
    lin, x = _packed_linear(32, 16), torch.randn(4, 16)
    with torch.no_grad():
        lin(x)
        first = lin.__dict__["_computron_packed"][2]
        lin(x)
        assert lin.__dict__["_computron_packed"][2] is first       # reused
        lin.weight.mul_(2)                                          # in place: its version moves
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.data = torch.randn(32, 16)                       # another buffer: its pointer moves
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert release_packs(lin) == 32 * 16 * 4 and release_packs(lin) == 0


@needs_onednn
def test_packing_stays_out_of_autograd_and_of_other_dtypes(pack_any_size):
    lin = _packed_linear(32, 16)
    out = lin(torch.randn(4, 16))                 # gradients on: F.linear, differentiable
    assert out.grad_fn is not None and packed_bytes(lin) == 0
    lin64 = _packed_linear(32, 16).double()
    with torch.no_grad():
        x = torch.randn(4, 16, dtype=torch.float64)
        torch.testing.assert_close(lin64(x), F.linear(x, lin64.weight, lin64.bias))
    assert packed_bytes(lin64) == 0


@needs_onednn
def test_a_weight_under_pack_min_keeps_f_linear_and_one_at_it_packs():
    from computron.kernels.cpu.linear import PACK_MIN
    small, big = _packed_linear(64, 64), _packed_linear(PACK_MIN // 50, 50)
    with torch.no_grad():
        for lin in (small, big):
            x = torch.randn(3, lin.in_features)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert packed_bytes(small) == 0 and packed_bytes(big) == PACK_MIN * 4


needs_blocks = pytest.mark.skipif(not cpu_linear.gemm.available(),
                                  reason="cpu_gemm's kernel is not built or loses to F.linear here")


@needs_blocks
def test_a_blocked_weight_is_called_the_short_way_only_where_it_applies(threads, pack_any_size):
    """After its first product a blocked weight has its kernel call (``cpu_gemm.Call``): later products in
    inference take it and equal ``F.linear``; with gradients on, a changed weight, another feature count, a
    strided input or more rows than the kernel takes, the long way (differentiable, packed again, a clear
    error, a copy, ``F.linear``)."""
    threads(1)
    torch.manual_seed(0)
    lin = _packed_linear(64, 32)
    with torch.inference_mode():
        lin(torch.randn(1, 32))
        call = lin.__dict__["_computron_call"]
        assert isinstance(call, cpu_linear.gemm.Call)
        for shape in [(1, 32), (8, 32), (2, 7, 32), (64, 32), (65, 32), (0, 32)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        strided = torch.randn(4, 64)[:, ::2]
        torch.testing.assert_close(lin(strided), F.linear(strided, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError):
            lin(torch.randn(3, 31))                  # as F.linear says: the kernel never reads past the weight
    with torch.no_grad():
        lin.weight.mul_(3)                           # its version moves: packed again, a new call
        x = torch.randn(2, 32)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert lin.__dict__["_computron_call"] is not call
    out = lin(torch.randn(2, 32))                    # gradients on: F.linear
    assert out.grad_fn is not None
    assert release_packs(lin) == 64 * 32 * 4 and "_computron_call" not in lin.__dict__


@needs_blocks
def test_a_weight_whose_blocks_are_padded_keeps_the_long_way(threads, pack_any_size):
    threads(1)
    lin = _packed_linear(40, 32)                     # 40 features: the last block padded
    with torch.inference_mode():
        x = torch.randn(3, 32)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert lin.__dict__["_computron_call"] is None and lin.packed_kind == cpu_linear.BLOCKED


@pytest.mark.parametrize("pack,pinned,packs", [("pinned", False, False), ("pinned", True, True), (True, False, True),
                                               (False, True, False)])
def test_a_shard_packs_its_linears_only_where_the_model_never_leaves(pack, pinned, packs, pack_any_size):
    """``EngineConfig.pack_cpu_linears``, as a worker builds a shard: the default ('pinned') packs a pinned
    model's Linears only; a model that swaps keeps its weights as the load copies them (no layout to rebuild
    after each load); True packs every model, False none."""
    from computron import EngineConfig, ModelConfig, zoo
    from computron.kernels.cpu import gemm
    from computron.storage.memory import DevicePool
    from computron.worker.shard_builder import ShardBuilder
    cpu = torch.device("cpu")
    builder = ShardBuilder(0, OneRank(), cpu, EngineConfig(pack_cpu_linears=pack), DevicePool(cpu), None, None)
    mc = ModelConfig("m", zoo.random_causal_lm, {"name": "opt-tiny", "seed": 0}, pinned=pinned)
    runner = builder.build("m", mc, host_room=lambda nbytes: True).runner
    linears = [m for m in runner.module.modules() if getattr(type(m), "uses_cpu_linear", False)]
    assert linears and {m.pack_weights for m in linears} == {packs and (packing_available() or gemm.available())}
