"""Swap benchmark: how close a model swap comes to the memory-copy limit, and how it compares to the paper's.

Prints exactly one JSON line on stdout; progress goes to stderr (the worker
processes' stdout is sent to stderr too, so nothing else reaches stdout).

One run starts three engines, one after the other (two cannot coexist in one
process), each serving two models of the same size with ``max_loaded=1``;
requests alternate between the two models, so every request swaps: one offload
of the resident model, one load of the other, then the forward.

1. ``fast_no_overlap``: ``EngineConfig(paper_mode=False, overlap=False)``;
2. ``paper``: ``EngineConfig(paper_mode=True)`` (per-tensor ``.to()``, copy-back offload);
3. ``fast``: ``EngineConfig(paper_mode=False, overlap=True)`` (the defaults).

(``--modes`` picks a subset; each engine's numbers are also logged to stderr
as soon as it is done, so a run cut short by a timeout still tells them.)

Warm-up: the first cycle (one request to each model: the first load of each,
and the first offload) is dropped; ``--repeats`` requests follow, each giving
one load, one offload and one time to first output. Every time is a median
over those repeats.

Fields (times in seconds, bandwidths in GB/s with GB = 1e9 bytes):

- ``bytes_per_rank``: the largest shard any rank holds of one model (from the
  workers' ready messages); with ``tp*pp == 1`` the whole model. ``size_gb`` is
  the whole model (unique parameters and buffers) in GB.
- ``limit_gbps``: the memory-copy limit: ``model bytes / (tp*pp)`` bytes (in
  the model's dtype) copied with a plain ``dst.copy_(src)`` between tensors
  allocated and touched beforehand, in this (the master) process: on CPU, CPU
  tensor into CPU tensor, with as many torch threads as a worker gets (the
  launcher's choice, ``limit_threads``); on CUDA, pinned host tensor into a
  device tensor, ``torch.cuda.synchronize()`` before and after. On CPU with
  ``tp*pp > 1`` the ranks share one memory system, and every rank loads its
  shard at the same moment: the limit is then ``tp*pp`` such copies run at
  once (one thread each) and ``limit_gbps`` is the bandwidth each of them got,
  which is what ``load_gbps`` (per rank) is compared with. On CUDA each rank
  has its own link, so one copy is timed. The copies are timed right after each measured request
  (3 each; the workers are idle then), and ``limit_gbps`` is the median of the
  ``limit_samples`` copies timed in the engine ``load_s`` comes from
  (``load_engine``), so that limit and load see the same background load: on a
  shared machine that matters (medians of the same 1 GB copy moved between 3
  and 20 GB/s from one minute to the next on a busy 2-core VM).
  ``limit_all_gbps`` is the median over every copy timed in the run, including
  ``--repeats`` before the first engine starts.
- ``load_s``: per load, the longest rank's load duration from
  ``SwapRecord.rank_times`` (worker clock: from taking the device buffers,
  through rebinding every parameter and starting the copy thread, to the last
  byte arriving), median over repeats, in the ``fast_no_overlap`` engine, so
  that no forward runs beside the copy (``load_engine``; the ``fast`` engine if
  ``--modes`` left the other out). ``load_gbps = bytes_per_rank / load_s``.
  ``load_overlap_s`` is the same in the ``fast`` engine, where the forward of
  the request runs beside the copy (layer by layer behind it).
- ``offload_s``: likewise for offloads (worker-side duration of the offload
  command), ``fast_no_overlap`` engine.
- ``load_master_s`` / ``offload_master_s`` (and ``paper_*``): the same swaps
  as the master sees them (``SwapRecord.duration``: command sent to last reply
  received), i.e. including the control-plane round trip.
- ``paper_load_s``, ``paper_offload_s``: as ``load_s``/``offload_s``, ``paper`` engine.
- ``ttfo_s`` / ``ttfo_no_overlap_s``: time to first output after a swap: from
  ``engine.submit`` of a request for the offloaded model to its answer, as the
  caller sees it (offload of the other model + load + forward), ``fast`` and
  ``fast_no_overlap`` engines. ``paper_ttfo_s`` likewise for the paper engine.
  ``forward_s``: the request's batch as the longest rank ran it (worker
  clock), ``fast_no_overlap`` engine, so ``ttfo_no_overlap_s`` is about
  ``offload_master_s + load_master_s + forward_s``; ``forward_overlap_s`` is
  the same in the ``fast`` engine, where it includes waiting for each layer's
  weights (so there it overlaps ``load_overlap_s``).
- ``load_vs_limit = load_gbps / limit_gbps``;
  ``speedup_vs_paper = (paper_load_s + paper_offload_s) / (load_s + offload_s)``;
  ``offload_vs_load = offload_s / load_s``.
- ``targets``: whether load_vs_limit >= 0.8, offload_vs_load <= 0.05, speedup_vs_paper >= 3.

Models: ``--model mlp`` (default) is ``zoo.mlp`` with ``--layers`` square
Linear layers of a width chosen to hit ``--size-gb``; ``--model opt-6.7b`` etc.
is ``zoo.random_causal_lm(name, fast_init=True, dtype=...)`` (``--size-gb`` is
then ignored), asked to generate one token from a 16-token prompt.

Run: ``python benchmarks/swap.py --size-gb 1`` (from the repo root, or
``PYTHONPATH=. python3 -m benchmarks.swap ...``).

``--pack-cpu-linears`` sets ``EngineConfig.pack_cpu_linears`` (field ``pack_cpu_linears``): the default
'pinned' packs no model here (neither is pinned); ``true`` packs each model's CPU Linears at its first forward
after every load, which the offload then drops (what the default did before 2026-12-07); ``false`` never packs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import threading
import time

if __package__ in (None, ""):  # run as a script: import from the repo, not from this folder
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

import torch  # noqa: E402

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo  # noqa: E402

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("fast_no_overlap", "paper", "fast")  # most needed first: a run cut short still logged those
LIMIT_SAMPLES_PER_SWAP = 3


def log(*args) -> None:
    print(f"[swap {time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs) if xs else None


# ---- models -----------------------------------------------------------------

def mlp_sizes(size_gb: float, dtype: str, layers: int, tp: int, pp: int):
    """Widths of a square MLP of ``layers`` Linear layers holding about ``size_gb`` GB."""
    layers = max(layers, pp)
    itemsize = _DTYPES[dtype].itemsize
    quantum = 64 * tp  # keeps the width divisible by tp (and friendly to kernels)
    width = math.sqrt(size_gb * 1e9 / (layers * itemsize))
    width = max(quantum, int(round(width / quantum)) * quantum)
    return (width,) * (layers + 1)


def model_configs(args):
    if args.model == "mlp":
        sizes = mlp_sizes(args.size_gb, args.dtype, args.layers, args.tp, args.pp)
        kw = {"sizes": sizes, "dtype": args.dtype}
        cfgs = [ModelConfig(f"m{i}", zoo.mlp, dict(kw, seed=i)) for i in range(2)]
        width, dtype = sizes[0], _DTYPES[args.dtype]

        def make_input():
            return torch.randn(1, width, dtype=dtype)
        desc = f"mlp({len(sizes) - 1}x{width}x{width})"
    else:
        kw = {"name": args.model, "dtype": args.dtype, "fast_init": True}
        cfgs = [ModelConfig(f"m{i}", zoo.random_causal_lm, dict(kw, seed=i)) for i in range(2)]
        vocab = zoo.hf_config(args.model).vocab_size
        gen = torch.Generator().manual_seed(0)

        def make_input():
            # the request format of the CausalLMBatchManager the engine builds for a causal LM
            return {"input_ids": torch.randint(3, vocab, (16,), generator=gen).tolist(), "max_tokens": 1}
        desc = args.model
    return cfgs, make_input, desc


def model_bytes(cfg: ModelConfig) -> int:
    """Bytes of the unique parameters and buffers of the whole model, built on the meta device."""
    kwargs = dict(cfg.model_kwargs)
    if "fast_init" in kwargs:
        kwargs["fast_init"] = False  # fast_init allocates real memory; plain init is free on meta
    with torch.device("meta"):
        m = cfg.model_fn(**kwargs)
    seen, total = set(), 0
    for t in list(m.parameters()) + list(m.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# ---- the memory-copy limit ----------------------------------------------------

class CopyLimit:
    """A plain ``dst.copy_(src)`` of ``nbytes`` between buffers allocated and touched up front.

    Sampled between requests (while the workers are idle), so that the limit is
    measured under the same background load as the swaps it is compared with.
    """

    def __init__(self, nbytes: int, dtype: torch.dtype, device: str, ranks: int = 1):
        self.device = device
        n = nbytes // dtype.itemsize
        self.nbytes = n * dtype.itemsize
        self.ranks = 1 if device == "cuda" else ranks  # CPU ranks share the memory bus: copy together
        if device == "cuda":
            self.pairs = [(torch.empty(n, dtype=dtype, pin_memory=True).fill_(1),
                           torch.empty(n, dtype=dtype, device="cuda").zero_())]
        else:
            self.pairs = [(torch.empty(n, dtype=dtype).fill_(1), torch.empty(n, dtype=dtype).fill_(0))
                          for _ in range(self.ranks)]
        self.samples = {}  # phase -> seconds of each copy
        self.sample(None)  # warm-up

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def sample(self, phase) -> float:
        self.sync()
        t0 = time.perf_counter()
        if self.ranks == 1:
            dst, src = self.pairs[0]
            dst.copy_(src, non_blocking=True)
        else:  # copy_ releases the GIL: the threads copy in parallel like the ranks do
            threads = [threading.Thread(target=d.copy_, args=(s,)) for s, d in self.pairs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self.sync()
        dt = time.perf_counter() - t0
        if phase is not None:
            self.samples.setdefault(phase, []).append(dt)
        return dt

    def gbps(self, *phases):
        xs = [t for p in (phases or self.samples) for t in self.samples.get(p, [])]
        return self.nbytes / median(xs) / 1e9 if xs else None

    def count(self, *phases):
        return sum(len(self.samples.get(p, [])) for p in (phases or self.samples))


# ---- one engine ---------------------------------------------------------------

async def _drive(engine, n_requests: int, make_input, timeout: float, limit: CopyLimit, warm: int, mode: str):
    latencies = []
    for i in range(n_requests):
        mid = f"m{i % 2}"
        t0 = time.perf_counter()
        out = await engine.submit(mid, make_input(), timeout=timeout)
        latencies.append(time.perf_counter() - t0)
        if out is None:
            raise RuntimeError(f"request {i} to {mid} returned no output")
        if i >= warm:  # limit samples beside each measured swap, taken while the workers are idle
            for _ in range(LIMIT_SAMPLES_PER_SWAP):
                limit.sample(mode)
        log(f"  request {i} ({mid}): {latencies[-1]:.3f}s")
    return latencies


def run_engine(mode: str, args, cfgs, make_input, limit: CopyLimit):
    config = EngineConfig(max_loaded=1, paper_mode=(mode == "paper"), overlap=(mode != "fast_no_overlap"),
                          device=args.device, start_timeout_s=args.start_timeout,
                          pack_cpu_linears=args.pack_cpu_linears)
    log(f"{mode}: starting workers (tp={args.tp}, pp={args.pp}); building two models ...")
    t0 = time.perf_counter()
    engine = LaunchEngine(config, cfgs, tp_world_size=args.tp, pp_world_size=args.pp)
    try:
        log(f"{mode}: ready after {time.perf_counter() - t0:.1f}s")
        shard = max(w.host_bytes["m0"] for w in engine.workers.values())
        warm = 2  # the first cycle: one request to each model
        lat = asyncio.run(_drive(engine, warm + args.repeats, make_input, args.request_timeout, limit, warm,
                                 mode))
        loads, offloads = engine.metrics("load"), engine.metrics("offload")
        batches = engine.metrics("batch")[warm:]
    finally:
        engine.close()
    errors = [r.error for r in loads + offloads if r.error]
    if errors:
        raise RuntimeError(f"{mode}: swaps failed: {errors}")
    # request i loads m(i%2) (loads[i]); from request 1 on it first offloads the other (offloads[i-1])
    loads, offloads = loads[warm:], offloads[warm - 1:]
    if len(loads) != args.repeats or len(offloads) != args.repeats:
        raise RuntimeError(f"{mode}: expected {args.repeats} loads and offloads after warm-up, "
                           f"got {len(loads)} and {len(offloads)}")

    def rank_max(r):
        return max(r.rank_durations.values())
    res = {
        "shard_bytes": shard,
        "load_s": median([rank_max(r) for r in loads]),
        "offload_s": median([rank_max(r) for r in offloads]),
        "load_master_s": median([r.duration for r in loads]),
        "offload_master_s": median([r.duration for r in offloads]),
        "ttfo_s": median(lat[warm:]),
        "forward_s": median([rank_max(r) for r in batches]),
    }
    log(f"{mode} engine: " + json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                                         for k, v in res.items()}))
    return res


# ---- main -----------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0, help="MLP weights, GB (1e9 bytes); ignored for OPT")
    p.add_argument("--model", default="mlp", help="'mlp' or an OPT shape name from computron.zoo (opt-6.7b, ...)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--layers", type=int, default=16, help="Linear layers of the MLP")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (fields of a skipped mode are null)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for workers to build the models")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--pack-cpu-linears", default="pinned", choices=("pinned", "true", "false"),
                   help="EngineConfig.pack_cpu_linears (CPU: 'true' packs every model's Linears at each load)")
    args = p.parse_args(argv)
    args.pack_cpu_linears = {"true": True, "false": False}.get(args.pack_cpu_linears, args.pack_cpu_linears)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model != "mlp" and args.model not in zoo.OPT_SHAPES:
        p.error(f"--model: 'mlp' or one of {sorted(zoo.OPT_SHAPES)}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(args.modes) - set(MODES)
    if bad or not args.modes:
        p.error(f"--modes: choose from {MODES}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def worker_threads(n_workers: int) -> int:
    """The torch threads each worker gets, as the launcher picks them (so the limit copy uses as many)."""
    try:
        from computron.runtime.process_setup import threads_per_worker as pick
    except ImportError:  # an older tree: the launcher's own helper
        from computron.runtime import launch
        pick = getattr(launch, "_threads_per_worker", None)
    if pick is not None:
        try:
            return pick(EngineConfig(), n_workers)
        except TypeError:  # an older launcher: _threads_per_worker(local_world)
            return pick(n_workers)
    return max(1, (os.cpu_count() or 1) // n_workers)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    cfgs, make_input, desc = model_configs(args)
    total = model_bytes(cfgs[0])
    n = args.tp * args.pp
    log(f"model {desc} {args.dtype}: {total / 1e9:.3f} GB, device={args.device}, torch {torch.__version__}")

    shard = total // n  # the limit copy's size (the workers report the real shards later)
    threads = worker_threads(n)
    log(f"limit: copy_ of {shard / 1e9:.3f} GB into preallocated memory ({args.device}, {threads} threads)")
    torch.set_num_threads(threads)  # for the whole master process, which computes nothing else
    limit = CopyLimit(shard, _DTYPES[args.dtype], args.device, ranks=n)
    for _ in range(args.repeats):
        limit.sample("before")
    log(f"limit: {limit.gbps('before'):.2f} GB/s before the engines start")

    results = {}
    for mode in args.modes:
        results[mode] = run_engine(mode, args, cfgs, make_input, limit)
    shard = next(iter(results.values()))["shard_bytes"]  # the real one, from the workers
    # load_s/offload_s come from the engine where no forward runs beside the copy, if it ran
    primary = next((m for m in ("fast_no_overlap", "fast") if m in results), None)
    fast = results.get(primary, {}) if primary else {}
    ovl = results.get("fast", {})
    noovl = results.get("fast_no_overlap", {})
    paper = results.get("paper", {})
    # compare the load with the copies timed in the same engine's window (see the docstring)
    limit_phases = (primary,) if primary else ()
    limit_gbps = limit.gbps(*limit_phases)
    load_s, offload_s = fast.get("load_s"), fast.get("offload_s")
    load_gbps = None if load_s is None else shard / load_s / 1e9
    pl, po = paper.get("load_s"), paper.get("offload_s")
    speedup = None if None in (pl, po, load_s, offload_s) else (pl + po) / (load_s + offload_s)
    out = {
        "model": desc, "dtype": args.dtype, "pack_cpu_linears": args.pack_cpu_linears,
        "size_gb": round(total / 1e9, 4), "bytes_per_rank": shard,
        "tp": args.tp, "pp": args.pp, "device": args.device, "torch": torch.__version__,
        "repeats": args.repeats,
        "limit_gbps": limit_gbps, "limit_samples": limit.count(*limit_phases),
        "limit_all_gbps": limit.gbps(), "limit_threads": threads, "limit_concurrent_copies": limit.ranks,
        "load_engine": primary,
        "load_s": load_s, "load_gbps": load_gbps, "offload_s": offload_s,
        "paper_load_s": pl, "paper_offload_s": po,
        "load_vs_limit": ratio(load_gbps, limit_gbps),
        "speedup_vs_paper": speedup,
        "offload_vs_load": ratio(offload_s, load_s),
        "ttfo_s": ovl.get("ttfo_s"), "ttfo_no_overlap_s": noovl.get("ttfo_s"),
        "paper_ttfo_s": paper.get("ttfo_s"),
        "load_overlap_s": ovl.get("load_s"), "offload_overlap_s": ovl.get("offload_s"),
        "load_master_s": fast.get("load_master_s"), "offload_master_s": fast.get("offload_master_s"),
        "paper_load_master_s": paper.get("load_master_s"), "paper_offload_master_s": paper.get("offload_master_s"),
        "paper_load_gbps": None if pl is None else shard / pl / 1e9,
        "forward_s": noovl.get("forward_s"), "forward_overlap_s": ovl.get("forward_s"),
    }
    lv, ol = out["load_vs_limit"], out["offload_vs_load"]
    out["targets"] = {
        "load_vs_limit>=0.8": None if lv is None else lv >= 0.8,
        "offload_vs_load<=0.05": None if ol is None else ol <= 0.05,
        "speedup_vs_paper>=3": None if speedup is None else speedup >= 3,
    }
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    for k, v in out.items():
        if isinstance(v, float):
            out[k] = float(f"{v:.4g}")
    return out


if __name__ == "__main__":
    # Keep stdout for the one JSON line: everything else, the spawned workers' output included
    # (they inherit file descriptor 1), goes to stderr.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    result = main()
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()
