"""The C kernels of ``computron.models`` on this CPU, each against the torch operator it replaces.

Prints exactly one JSON line on stdout. One intra-op thread (where a worker uses them); the best of
``--repeats`` alternated timings (kernel, torch, kernel, torch, ...) of each case, in milliseconds:

- ``gemm``: ``cpu_gemm``'s blocked product against ``F.linear`` for 1 and 8 rows by SmolLM2-135M's LM head
  (49152 x 576, 113 MB: past the caches, as a forward's weights are) and by its largest layer weight
  (1536 x 576); ``ratio`` is kernel / ``F.linear``;
- ``attention``: ``cpu_attention``'s decode call for 8 rows of SmolLM2's shape (9 query heads on 3 KV heads
  of 64) over 16, 48 and 96 keys of a paged pool, against ``cpu_attention.reference`` (the pool gathered, then
  SDPA: what a step does without the kernel);
- ``gemm_verdict``: what ``cpu_gemm`` decided on this machine (its one-time timing against ``F.linear``);
- ``per_call``: what a decode step of SmolLM2 spends around its products, one row: its 211 Linear calls on
  blocked weights (a 192 x 576 weight) the short way (``FewRowLinear``: ``cpu_gemm.Call``) against the long
  way (``cpu_linear.linear``), and its 61 RMS norms as ``cpu_norm.FusedRMSNorm`` against transformers'
  ``LlamaRMSNorm``.

    .venv/bin/python benchmarks/cpu_kernels.py              # seconds
    .venv/bin/python benchmarks/cpu_kernels.py --quick      # small shapes, one repeat (the tests' path)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))
from workload import machine_info  # noqa: E402


def best_pair(kernel, torch_op, repeats: int):
    best = [float("inf"), float("inf")]
    for _ in range(repeats + 1):  # the first round warms both up
        for i, fn in enumerate((kernel, torch_op)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return {"kernel_ms": round(best[0] * 1e3, 4), "torch_ms": round(best[1] * 1e3, 4),
            "ratio": round(best[0] / best[1], 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small shapes and one repeat (the tests' path)")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(json.dumps(measure(args)), flush=True)
    finally:
        torch.set_num_threads(threads)
    return 0


def measure(args) -> dict:
    from computron.kernels.cpu import attention as cpu_attention
    from computron.kernels.cpu import gemm as cpu_gemm
    repeats = 1 if args.quick else args.repeats
    out = {"bench": "cpu_kernels", "repeats": repeats, "quick": args.quick, "gemm": {}, "attention": {}}
    gen = torch.Generator().manual_seed(0)
    if cpu_gemm.built():
        for name, shape in (("lm_head", (4096 if args.quick else 49152, 576)), ("mlp", (1536, 576))):
            w = torch.randn(*shape, generator=gen)
            blocked = cpu_gemm.block(w)
            for rows in (1, 8):
                x = torch.randn(rows, shape[1], generator=gen)
                torch.testing.assert_close(cpu_gemm.matmul(x, blocked, None, shape[0]), F.linear(x, w),
                                           rtol=1e-4, atol=1e-3)
                out["gemm"][f"{name}_rows{rows}"] = best_pair(
                    lambda: cpu_gemm.matmul(x, blocked, None, shape[0]), lambda: F.linear(x, w), repeats)
        out["gemm_verdict"] = cpu_gemm.available()
    else:
        out["gemm"] = "not built here (see the WARNING)"
    if cpu_attention.available():
        rows, heads, kv_heads, dim, slots_n = 8, 9, 3, 64, 4096
        pool_k, pool_v = (torch.randn(kv_heads, slots_n, dim, generator=gen) for _ in range(2))
        q = torch.randn(rows, heads, 1, dim, generator=gen)
        for keys in (16,) if args.quick else (16, 48, 96):
            lengths = torch.full((rows,), keys)
            slots = torch.randperm(slots_n, generator=gen)[:rows * keys].view(rows, keys)
            call = (q, pool_k, pool_v, slots, lengths, dim ** -0.5)
            torch.testing.assert_close(cpu_attention.decode(*call), cpu_attention.reference(*call),
                                       rtol=1e-4, atol=1e-4)
            out["attention"][f"keys{keys}"] = best_pair(
                lambda: [cpu_attention.decode(*call) for _ in range(30)],  # a step's 30 layers
                lambda: [cpu_attention.reference(*call) for _ in range(30)], repeats)
    else:
        out["attention"] = "not built here (see the WARNING)"
    out["per_call"] = per_call(gen, repeats)
    out["machine"] = machine_info()
    return out


def per_call(gen, repeats: int) -> dict:
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from computron.kernels.cpu import gemm as cpu_gemm
    from computron.kernels.cpu import linear as cpu_linear
    from computron.kernels.cpu import norm as cpu_norm
    out = {}
    x = torch.randn(1, 1, 576, generator=gen)
    lin = nn.Linear(576, 192, bias=False)  # made outside inference mode, as a model's weights are
    cpu_linear.use_cpu_kernels(lin, pack=True)
    hf, fused = LlamaRMSNorm(576, eps=1e-5), LlamaRMSNorm(576, eps=1e-5)
    cpu_norm.use_fused_norms(fused)
    with torch.inference_mode():
        if cpu_gemm.available():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-4, atol=1e-4)
            out["linear_calls211"] = best_pair(lambda: [lin(x) for _ in range(211)],
                                               lambda: [cpu_linear.linear(x, lin.weight, None, lin)
                                                        for _ in range(211)], repeats)
        assert torch.equal(fused(x), hf(x))
        out["rms_norm_calls61"] = best_pair(lambda: [fused(x) for _ in range(61)],
                                            lambda: [hf(x) for _ in range(61)], repeats)
    return out


if __name__ == "__main__":
    sys.exit(main())
