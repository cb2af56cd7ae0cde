"""CPU Linears: ``F.linear`` against the packed and the weight-first products of ``computron.kernels.cpu.linear``.

Prints exactly one JSON line on stdout; progress goes to stderr.

A random-weight ``--model`` (zoo OPT shape) is built in this process. Measured side by side, the two forms
alternating, medians of ``--repeats``:

- ``chain``: for each intra-op thread count of ``--threads`` and each row count of ``--rows``, one pass of
  activations of that many rows through every Linear of the model, the LM head included (distinct weights,
  so that they stream from memory as in a forward), by ``F.linear``, by ``cpu_linear.weight_first``
  (forced, whatever ``cpu_linear.linear``'s rule would pick) and on weights packed for oneDNN (packed before
  the timing: a load packs once); ``ratio`` is weight-first / ``F.linear``, ``packed_ratio`` packed / ``F.linear``;
  ``read_once``: a sum over one buffer as large as all those weights (what streaming them costs at least);
- ``decode``: at the largest thread count, a prefill of ``--prompt`` tokens and greedy decode steps of 1
  and of ``--batch`` sequences through the whole model, its Linears plain (``F.linear``), swapped by
  ``use_cpu_kernels(pack=False)`` (weight-first for a few rows) and by ``use_cpu_kernels(pack=True)`` (the
  engine's CPU default); ``same_tokens``: all three picked the same greedy tokens.

    .venv/bin/python benchmarks/cpu_linear.py            # opt-125m, threads 1 and 2 (about a minute)
    .venv/bin/python benchmarks/cpu_linear.py --quick    # opt-tiny (the tests' path)
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from workload import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--threads", default="1,2", help="intra-op thread counts, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts of the chain, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="sequences of the batched decode step")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens of the decode comparison")
    p.add_argument("--steps", type=int, default=6, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="opt-tiny, rows 1 and 8, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rows, args.repeats, args.steps = "opt-tiny", "1,8", 2, 3
    return args


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def chain(linears, rows: int, repeats: int) -> dict:
    """Milliseconds of one pass of ``rows`` rows through ``linears``, each form, alternating."""
    import torch
    import torch.nn.functional as F

    from computron.kernels.cpu.linear import PACK_ROWS, packing_available, weight_first
    xs = [torch.randn(rows, lin.in_features) for lin in linears]
    forms = {"f_linear": lambda: [F.linear(x, lin.weight, lin.bias) for x, lin in zip(xs, linears)],
             "weight_first": lambda: [weight_first(x, lin.weight, lin.bias) for x, lin in zip(xs, linears)]}
    if packing_available():
        packs = [torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), PACK_ROWS) for lin in linears]
        forms["packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, lin.bias, "none", [], "")
                                   for x, p, lin in zip(xs, packs, linears)]
    flat = torch.randn(sum(lin.weight.numel() for lin in linears))  # the weights' bytes, read once by a sum
    forms["read_once"] = lambda: flat.sum()
    times = {name: [] for name in forms}
    with torch.no_grad():
        for name, fn in forms.items():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in forms.items():
                times[name].append(median_ms(fn, 1))
    out = {name: float(np.median(ts)) for name, ts in times.items()}
    out["ratio"] = out["weight_first"] / out["f_linear"]
    if "packed" in out:
        out["packed_ratio"] = out["packed"] / out["f_linear"]
    return out


def generate(model, batch: int, prompt: int, steps: int):
    """(prefill ms, median decode step ms, the greedy tokens) of ``batch`` sequences."""
    import torch
    from transformers import DynamicCache
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt), generator=gen)
    mask = torch.ones(batch, prompt, dtype=torch.int64)
    decoder = model.model.decoder
    # transformers renamed the decoders' past_key_values to cache
    key = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = DynamicCache()
        t0 = time.perf_counter()
        hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache}).last_hidden_state
        cur = model.lm_head(hidden[:, -1, :]).argmax(-1, keepdim=True)
        prefill_ms, step_ms, tokens = (time.perf_counter() - t0) * 1e3, [], [cur]
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            t0 = time.perf_counter()
            hidden = decoder(input_ids=cur, attention_mask=mask, use_cache=True, **{key: cache}).last_hidden_state
            cur = model.lm_head(hidden[:, -1, :]).argmax(-1, keepdim=True)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            tokens.append(cur)
    return prefill_ms, float(np.median(step_ms)), torch.cat(tokens, dim=1)


def decode(model, args) -> dict:
    """Prefill and decode steps with plain Linears, weight-first and packed ones, alternating."""
    import torch
    from torch import nn

    from computron.kernels.cpu.linear import FewRowLinear, use_cpu_kernels
    linears = [m for m in model.modules() if type(m) in (nn.Linear, FewRowLinear)]

    def plain():
        for m in linears:
            m.__class__ = nn.Linear

    variants = {"f_linear": plain, "weight_first": lambda: use_cpu_kernels(model, pack=False),
                "packed": lambda: use_cpu_kernels(model, pack=True)}
    out, tokens = {}, {}
    for batch in (1, args.batch):
        rows = {name: {"prefill_ms": [], "step_ms": []} for name in variants}
        for _ in range(args.repeats):
            for name, setup in variants.items():
                setup()
                prefill_ms, step_ms, toks = generate(model, batch, args.prompt, args.steps)
                rows[name]["prefill_ms"].append(prefill_ms)
                rows[name]["step_ms"].append(step_ms)
                tokens.setdefault(name, {})[batch] = toks
        res = {name: {k: float(np.median(v)) for k, v in r.items()} for name, r in rows.items()}
        for name in ("weight_first", "packed"):
            res[f"{name}_step_ratio"] = res[name]["step_ms"] / res["f_linear"]["step_ms"]
            res[f"{name}_prefill_ratio"] = res[name]["prefill_ms"] / res["f_linear"]["prefill_ms"]
        out[str(batch)] = res
        log(f"  decode batch {batch}: {res}")
    plain()
    out["same_tokens"] = all(torch.equal(toks, tokens[name][b]) for b, toks in tokens["f_linear"].items()
                             for name in ("weight_first", "packed"))
    return out


def main(argv=None):
    args = parse_args(argv)
    import torch
    from torch import nn

    from computron.testing import zoo
    threads = [int(t) for t in args.threads.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    before = torch.get_num_threads()
    log(f"building a random {args.model}")
    model = zoo.random_causal_lm(args.model, seed=0, fast_init=True).eval()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    doc = {"benchmark": "cpu_linear", "model": args.model, "linears": len(linears), "repeats": args.repeats,
           "chain": {}}
    try:
        for n in threads:
            torch.set_num_threads(n)
            doc["chain"][str(n)] = {}
            for r in rows:
                doc["chain"][str(n)][str(r)] = chain(linears, r, args.repeats)
                log(f"  {n} threads, {r} rows: {doc['chain'][str(n)][str(r)]}")
        torch.set_num_threads(max(threads))
        doc["decode"] = {"threads": max(threads), "prompt": args.prompt, "batch": args.batch, **decode(model, args)}
    finally:
        torch.set_num_threads(before)
    doc["machine"] = machine_info()
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
