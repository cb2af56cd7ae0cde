"""TP forward benchmark: a split decoder's forward through DTensor's dispatch against on its local shards.

Prints exactly one JSON line on stdout; progress goes to stderr.

``--tp`` processes (gloo, ``cpu_count / tp`` threads each) build the same random ``--model`` (zoo OPT shape)
three times, its decoder layers split by the family's TP plan, and time, alternately, repeat after repeat:

- ``local``: what the workers run (``models.local_tp``: the split Linears as plain matmuls on their shards,
  one all-reduce per row-parallel one), under ``torch.no_grad()``;
- ``dtensor``: ``parallelize_module`` alone (every split Linear through DTensor's dispatch), under
  ``torch.no_grad()``;
- ``dtensor_inference_mode``: the same under ``torch.inference_mode()``, what the workers ran before
  (DTensor's sharding propagation misses its cache on inference tensors and redistributes by all-gathers).

Per variant, medians over ``--repeats`` of the slowest rank: ``prefill_s`` (one prompt of ``--prompt``
tokens), ``decode_s`` per batch size of ``--batches`` (one new token per row over a KV cache of the
prompt). Ratios: ``dtensor_vs_local`` and ``inference_mode_vs_local`` (decode of the first batch size).
``local_equals_dtensor``: whether the two splits gave the same logits for the prompt (within 1e-4).

    .venv/bin/python benchmarks/tp_forward.py            # opt-125m, TP=2 (about a minute)
    .venv/bin/python benchmarks/tp_forward.py --quick    # opt-tiny, 2 repeats (the tests' path)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

VARIANTS = ("local", "dtensor", "dtensor_inference_mode")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape (random weights)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (the KV cache the decode extends)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="opt-tiny, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.repeats = "opt-tiny", 2
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.tp < 2:
        p.error("--tp must be at least 2: TP=1 splits nothing")
    return args


def build(args, variant, mesh, group):
    """The model with its decoder layers split as ``variant`` splits them."""
    from torch.distributed.tensor.parallel import parallelize_module

    from computron import zoo
    from computron.models.local_tp import split_linears
    from computron.models.families import decoder_family, divide_widths
    model = zoo.random_causal_lm(args.model, seed=0).eval()
    family = decoder_family(model)
    for layer in model.model.decoder.layers:
        if variant == "local":
            split_linears(layer, family.tp_plan(), mesh, group, src_data_rank=None)
        else:
            parallelize_module(layer, mesh, family.tp_plan(), src_data_rank=None)
        divide_widths(layer, family, args.tp)
    return model


def rank_main(rank, args, port, out_path):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        models = {v: build(args, v, mesh, dist.group.WORLD) for v in ("local", "dtensor")}
        models["dtensor_inference_mode"] = models["dtensor"]
        gen = torch.Generator().manual_seed(1)
        prompt = {b: torch.randint(4, 50, (b, args.prompt), generator=gen) for b in {1, *args.batches}}
        nxt = {b: torch.randint(4, 50, (b, 1), generator=gen) for b in args.batches}
        with torch.no_grad():
            logits = {v: models[v](prompt[1]).logits for v in ("local", "dtensor")}
        same = bool(torch.allclose(logits["local"], logits["dtensor"], atol=1e-4, rtol=1e-4))

        def timed(fn):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took)

        times = {v: {"prefill": [], **{b: [] for b in args.batches}} for v in VARIANTS}
        for rep in range(args.repeats + 1):  # the first round warms up, not counted
            for v in VARIANTS:
                model = models[v]
                with torch.inference_mode() if v == "dtensor_inference_mode" else torch.no_grad():
                    t = {"prefill": timed(lambda: model(prompt[1], use_cache=True))}
                    for b in args.batches:
                        cache = model(prompt[b], use_cache=True).past_key_values
                        kv = copy.deepcopy(cache)
                        t[b] = timed(lambda: model(nxt[b], past_key_values=kv, use_cache=True))
                if rep:
                    for k, x in t.items():
                        times[v][k].append(x)
            if rank == 0:
                print(f"  repeat {rep}/{args.repeats}", file=sys.stderr, flush=True)
        if rank == 0:
            out = {v: {"prefill_s": float(np.median(t["prefill"])),
                       "decode_s": {str(b): float(np.median(t[b])) for b in args.batches}}
                   for v, t in times.items()}
            out["local_equals_dtensor"] = same
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    import importlib
    import tempfile

    import torch.multiprocessing as mp

    from workload import machine_info
    args = parse_args(argv)
    print(f"{args.model}, TP={args.tp}: {', '.join(VARIANTS)}, {args.repeats} repeats", file=sys.stderr, flush=True)
    importlib.import_module("transformers.models.opt.modeling_opt")  # once, before the ranks fork
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "out.json")
        # fork: nothing has run a torch op here yet (no thread pool to inherit), and the ranks skip the imports
        mp.start_processes(rank_main, args=(args, free_port(), out_path), nprocs=args.tp, join=True,
                           start_method="fork")
        with open(out_path) as f:
            res = json.load(f)
    first = str(args.batches[0])
    decode = {v: res[v]["decode_s"][first] for v in VARIANTS}
    doc = {"benchmark": "tp_forward", "model": args.model, "tp": args.tp, "prompt": args.prompt,
           "batches": args.batches, "repeats": args.repeats, **res,
           "dtensor_vs_local": decode["dtensor"] / decode["local"],
           "inference_mode_vs_local": decode["dtensor_inference_mode"] / decode["local"],
           "machine": machine_info()}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
