"""``models/decode_compile`` without compiling anything: which settings compile where, the flag's
validation, that only decode steps go to the compiler, the single warning and eager fallback when
compiling fails, and the release (the process-wide reset only when the last compiled model leaves).
``torch.compile`` is replaced by a stand-in, so these run in milliseconds; tests/engine/test_decode_compile.py
compiles for real."""
from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.exc import TorchDynamoException

from computron import EngineConfig
from computron.models import decode_compile as dc
from computron.models.decode_compile import DecodeCompiler, compile_mode, wants_compile

pytestmark = pytest.mark.unit


class Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x


@pytest.fixture
def fake_compile(monkeypatch):
    """torch.compile -> a wrapper that records its calls (or raises, where ``broken``); counts resets."""
    state = {"compiled": [], "calls": 0, "resets": 0, "broken": False}

    def compile_(module, **kw):
        state["compiled"].append(kw)

        def run(**kwargs):
            state["calls"] += 1
            if state["broken"]:
                raise TorchDynamoException("inductor: no C++ compiler")
            return module(**kwargs)
        return run
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(torch.compiler, "reset", lambda: state.__setitem__("resets", state["resets"] + 1))
    monkeypatch.setattr(dc, "REGISTRY", dc._Registry())
    return state


def test_settings_by_device():
    assert [wants_compile(s, "cuda") for s in ("off", "auto", "on")] == [False, True, True]
    assert [wants_compile(s, "cpu") for s in ("off", "auto", "on")] == [False, dc.CPU_WINS, True]
    assert compile_mode("cuda") == "reduce-overhead" and compile_mode("cpu") is None
    assert compile_mode("cuda", graphs=False) is None, "shapes that never repeat: no CUDA graphs"
    with pytest.raises(ValueError, match="compile_decode must be one of"):
        wants_compile("yes", "cpu")


def test_engine_config_flag():
    assert EngineConfig().compile_decode == "auto"
    assert EngineConfig(compile_decode="off").compile_decode == "off"
    with pytest.raises(ValueError, match=r"EngineConfig.compile_decode=True: must be 'off', 'auto' or 'on'"):
        EngineConfig(compile_decode=True)


def test_only_decode_steps_compile_lazily_and_once(fake_compile):
    d = DecodeCompiler(Double(), "on", torch.device("cpu"))
    x = torch.ones(2, 1)
    assert torch.equal(d(False, x=x), 2 * x) and not d.active and not fake_compile["compiled"]
    for _ in range(3):
        assert torch.equal(d(True, x=x), 2 * x)
    assert d.active and d.compiles == 1 and fake_compile["calls"] == 3
    assert fake_compile["compiled"] == [{"dynamic": True, "mode": None}]
    off = DecodeCompiler(Double(), "off", torch.device("cpu"))
    off(True, x=x)
    assert not off.active and len(fake_compile["compiled"]) == 1


def test_failed_compile_warns_once_and_runs_eagerly(fake_compile, caplog):
    fake_compile["broken"] = True
    d = DecodeCompiler(Double(), "on", torch.device("cpu"))
    x = torch.arange(3.0)[:, None]
    with caplog.at_level(logging.WARNING, logger="computron.models.decode_compile"):
        outs = [d(True, x=x) for _ in range(4)]
    assert all(torch.equal(o, 2 * x) for o in outs)
    assert d.failed and not d.active and fake_compile["calls"] == 1, "tried once, eager from then on"
    warned = [r for r in caplog.records if "compile_decode" in r.getMessage()]
    assert len(warned) == 1 and "no C++ compiler" in warned[0].getMessage()


class Poisoned(torch.nn.Module):
    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative input")
        return x


def test_a_models_own_error_fails_the_step_and_keeps_the_compiled_step(fake_compile):
    d = DecodeCompiler(Poisoned(), "on", torch.device("cpu"))
    with pytest.raises(ValueError, match="negative input"):
        d(True, x=-torch.ones(1, 1))
    assert d.active and not d.failed and fake_compile["calls"] == 1, "raised once, not retried eagerly"
    assert torch.equal(d(True, x=torch.ones(1, 1)), torch.ones(1, 1)) and fake_compile["calls"] == 2


def test_release_resets_the_compiler_when_the_last_compiled_model_leaves(fake_compile):
    a, b = (DecodeCompiler(Double(), "on", torch.device("cpu")) for _ in range(2))
    x = torch.ones(1, 1)
    a(True, x=x)
    b(True, x=x)
    assert a.release() and not a.active and fake_compile["resets"] == 0, "b still compiled: caches stay"
    assert not a.release(), "nothing held any more"
    assert b.release() and fake_compile["resets"] == 1
    b(True, x=x)
    assert b.active and b.compiles == 2, "the next residency compiles again"


def test_a_cpu_offload_keeps_the_compiled_step_a_cuda_offload_drops_it(fake_compile):
    cpu = DecodeCompiler(Double(), "on", torch.device("cpu"), eager_first=True)
    x = torch.ones(1, 1)
    cpu(True, x=x)
    assert not cpu.active and cpu.warmed, "the first decode step runs eagerly"
    cpu(True, x=x)
    assert cpu.active and fake_compile["calls"] == 1
    assert not cpu.offload() and cpu.active and not cpu.warmed
    cpu(True, x=x)
    cpu(True, x=x)
    assert cpu.compiles == 1 and fake_compile["calls"] == 2, "the next residency: one eager step, then the same code"
    gpu = DecodeCompiler(Double(), "on", torch.device("cuda"))
    gpu(True, x=x)
    assert gpu.active and gpu.offload() and not gpu.active, "CUDA graphs' memory goes with the residency"
    assert cpu.release() and fake_compile["resets"] == 1


class Applying:
    """A stand-in for ``LoraSlots`` in the middle of a forward with some adapter."""
    applying = True


def test_runner_compiles_decode_steps_only_without_adapters(fake_compile):
    from transformers import DynamicCache

    from computron import ModelConfig
    from computron.comm.topology import Layout
    from computron.models import StageContext, make_runner
    from computron.testing.zoo import random_causal_lm

    class OneRank:
        layout = Layout(1, 1, 1, False)
        rank, stage, tp_rank, tp_group, data = 0, 0, 0, None, None

    ctx = StageContext(OneRank(), torch.device("cpu"), "m", scatter_from=None, compile_decode="on")
    runner = make_runner(random_causal_lm("llama-tiny", seed=0), ModelConfig("m", random_causal_lm,
                                                                              {"name": "llama-tiny"}), ctx)
    ids, cache = torch.tensor([[5, 6, 7]]), DynamicCache()
    with torch.inference_mode():
        runner._stage_forward(ids, torch.ones(1, 3), None, cache)
        assert not runner.decode.active, "a prefill stays eager"
        runner.lora = Applying()
        runner._stage_forward(ids[:, :1], torch.ones(1, 4), None, cache)
        assert not runner.decode.active, "a decode step with adapters stays eager"
        runner.lora = None
        runner._stage_forward(ids[:, :1], torch.ones(1, 5), None, cache)
        assert not runner.decode.active, "a residency's first decode step packs the CPU Linears, eagerly"
        runner._stage_forward(ids[:, :1], torch.ones(1, 6), None, cache)
    assert runner.decode.active and fake_compile["calls"] == 1
    runner.release_resident()
    assert runner.decode.active and not runner.decode.warmed, "a CPU offload keeps the code, re-arms the warm-up"
    runner.drop_all()
    assert not runner.decode.active and fake_compile["resets"] == 1, "removing the model drops it"
