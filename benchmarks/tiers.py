"""Tiers benchmark: start-up and the disk tier against their own floors, and more checkpoints than memory.

Prints exactly one JSON line on stdout; progress goes to stderr.

``--models`` random-weight checkpoints (``tiers_floor.write_checkpoints``, safetensors, written once to
``--dir`` and kept) are served at TP=``--tp`` x PP=``--pp`` with ``max_loaded=1``. Every measurement is
paired with its floor in the same run (this machine is shared, and its disk's speed drifts 2-3x within
minutes: only the ratios compare). The floors are bare processes (``tiers_floor.py``): started as the
engine's workers are here (``spawn``: the engines run with ``start_method="spawn"``, so that every start
is cold, as a process's first launch is), importing only torch, transformers and the model's module, then
reading the very byte ranges each rank reads (``slice_reads.read_spans`` of each rank's shard), one
plain thread each, one process per rank, all at once. The page cache of every checkpoint file is dropped
(``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed) before each engine start, each floor, each
request and each paired read: every figure is cold (``--disk-rows`` adds warm ones).

- ``startup_vs_floor``: median over ``--startup-reps`` pairs (the order alternates, an even count by default:
  whichever of the two starts second is faster on this machine, ``startup_vs_floor_by_order`` shows by how
  much; and every file the libraries' import reads is read before each, ``tiers_floor.warm_imports``, so
  that they are cached for both alike) of spawn-to-ready (``LaunchEngine``, every shard read into host
  memory) / the floor: ``floor_import_s`` (the bare processes' spawn until all have imported) +
  ``floor_read_s`` (the same number of bare processes reading every slice their rank reads at start-up, at
  once, into fresh memory). ``startup_cpu_vs_floor``: the same for the CPU seconds of the workers until
  ready and of the bare processes (``startup_cpu_s``, ``floor_cpu_s``). From the workers' logs, the
  slowest rank's ``worker_up_s`` (its process's start to its first line: the interpreter, computron and
  torch) and ``build_s`` (building and reading every model, the import of transformers included).
- ``disk_vs_concurrent_read``: an engine with ``host_budget`` = ``--host-models`` shards serves
  ``--rounds`` round robins over the models (every load beyond the budget's comes from disk); right
  before and right after each disk-tier load, ``tp x pp`` bare processes read the same model's bytes
  at once into reused memory (``concurrent_read_gbps``: the geometric mean of the two). Both GB/s are
  slice bytes of all ranks / the slowest rank's read seconds (``Loaded.read_s``); the ratio is the median
  over disk-tier loads of each load's GB/s / its pair's. The loads run with ``EngineConfig(overlap=False)``
  unless ``--overlap``: with overlap, the request's batch computes layer by layer while later layers are
  read, and on a CPU its forward (3 s for 4 tokens of an fp16 opt-350m on this 2-core machine) takes the
  cores the read needs; on a GPU it computes on the device. ``host_to_device_gbps``, ``swap_s_host`` /
  ``swap_s_disk``: medians of host-tier and disk-tier loads.
- ``beyond_memory`` (``--beyond-memory``, ``tiers_beyond.py``): checkpoints whose total exceeds the
  machine's memory, served with a small ``host_budget``; every model must answer what transformers'
  ``generate`` of its checkpoint answers, and every process's peak RSS stay within its budget + 1 GiB.

    .venv/bin/python benchmarks/tiers.py                  # 8 x opt-125m (vocab 512) fp16, ~5 min
    .venv/bin/python benchmarks/tiers.py --model opt-350m
    .venv/bin/python benchmarks/tiers.py --only beyond    # 10 x opt-1.3b fp16 (26 GB, written once)
    .venv/bin/python benchmarks/tiers.py --disk-rows --model opt-1.3b --vocab 0 --models 2 --tp 1  # gpu_check.sh
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]  # benchmarks/http.py is not stdlib http
sys.path.append(_HERE)  # tiers_floor, tiers_beyond

import argparse  # noqa: E402
import asyncio  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo  # noqa: E402
from computron.comm import messages as msg  # noqa: E402

import tiers_floor as floor  # noqa: E402


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape (random weights)")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--vocab", type=int, default=512, help="0: the shape's own vocabulary")
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--device", default=None, help="EngineConfig.device (None: cuda where there is one)")
    p.add_argument("--startup-reps", type=int, default=6,
                   help="engine / floor start-up pairs (even: as many with the engine first as with the floor first)")
    p.add_argument("--host-models", type=int, default=3, help="host_budget in shards of one model")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--dir", default="/work/tiers-data" if os.path.isdir("/work") else
                   os.path.join(tempfile.gettempdir(), "computron-tiers"),
                   help="where the checkpoints are written once and kept")
    p.add_argument("--disk-rows", action="store_true",
                   help="only the disk tier: every load from disk, page cache dropped (cold) and warm, each "
                        "paired with the bare read (the rows of gpu_check.sh)")
    p.add_argument("--only", choices=("startup", "disk", "beyond"),
                   help="measure start-up, the disk tier, or beyond_memory alone")
    p.add_argument("--overlap", action="store_true",
                   help="disk tier: EngineConfig.overlap=True (each request's batch computes while its weights load)")
    p.add_argument("--beyond-memory", action="store_true", help="also the beyond_memory run (tiers_beyond.py)")
    p.add_argument("--beyond-model", default="opt-1.3b")
    p.add_argument("--beyond-vocab", type=int, default=0)
    p.add_argument("--beyond-models", type=int, default=10)
    p.add_argument("--beyond-host-models", type=int, default=1, help="its host_budget, in shards")
    p.add_argument("--beyond-rounds", type=int, default=1, help="round robins over them (each load from disk)")
    return p.parse_args(argv)


def checkpoints(args, model: str, n: int, vocab: int):
    """``n`` checkpoints of shape ``model`` in ``args.dir`` (written once, kept)."""
    return floor.write_checkpoints(model, args.dir, n, args.dtype, vocab, log)


def files_of(paths):
    return [f for p in paths for f in sorted(glob.glob(os.path.join(p, "*.safetensors")))]


def worker_seconds(log_dir: str):
    """(the slowest rank's seconds from its process's start to its first log line, after the imports of
    computron and torch; the slowest rank's model building, its shards read too), from the workers' logs."""
    up, build = [], []
    for f in glob.glob(os.path.join(log_dir, "worker_*.log")):
        with open(f) as fh:
            text = fh.read()
        up += [float(m) for m in re.findall(r" process up ([0-9.]+)s after it started", text)]
        build += [float(m) for m in re.findall(r" built all \d+ models in ([0-9.]+)s", text)]
    return max(up, default=float("nan")), max(build, default=float("nan"))


def workers_cpu_s(engine) -> float:
    """CPU seconds (user + system) the engine's worker processes have used so far."""
    import psutil
    return sum(sum(psutil.Process(w.pid).cpu_times()[:2]) for w in engine.workers.values())


def launch(args, configs, log_dir, files, **cfg):
    """``(engine, spawn-to-ready seconds)``, the page cache of ``files`` dropped first."""
    floor.release_child()
    floor.drop_cache(files)
    shutil.rmtree(log_dir, ignore_errors=True)
    t0 = time.perf_counter()
    engine = LaunchEngine(EngineConfig(max_loaded=1, log_dir=log_dir, start_timeout_s=1800, device=args.device,
                                       start_method="spawn", **cfg), configs, args.tp, args.pp)
    return engine, time.perf_counter() - t0


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def measure_startup(args, configs, spans, module, files, work, res) -> None:
    """``--startup-reps`` pairs of engine start-up and its floor, alternating which goes first, each after
    every file of the libraries' import was read (their files cached for both alike)."""
    n = args.tp * args.pp
    pairs, build, up, shard = [], [], [], 0
    for rep in range(args.startup_reps):
        got = {}
        for what in (("floor", "engine") if rep % 2 == 0 else ("engine", "floor")):
            floor.warm_imports(module)
            if what == "floor":
                got["floor"] = floor.startup_floor(spans, module, n, files, cold=True, models=range(len(configs)))
                continue
            log_dir = os.path.join(work, f"startup{rep}")
            engine, got["engine"] = launch(args, configs, log_dir, files)
            got["cpu"] = workers_cpu_s(engine)
            shard = max(max(w.host_bytes.values()) for w in engine.workers.values())
            engine.close()
            up_s, build_s = worker_seconds(log_dir)
            build.append(build_s)
            up.append(up_s)
        f = got["floor"]
        pairs.append((got["engine"], f["floor_s"], f["import_s"], f["read_s"], got["cpu"], f["cpu_s"]))
        log(f"start-up {rep}: engine {got['engine']:.2f}s (building {build[-1]:.2f}s; {got['cpu']:.1f} CPU s), "
            f"floor {f['floor_s']:.2f}s = imports {f['import_s']:.2f}s + reads {f['read_s']:.2f}s "
            f"({f['cpu_s']:.1f} CPU s) -> {got['engine'] / f['floor_s']:.2f}")
    res.update({"startup_s": med([p[0] for p in pairs]), "startup_floor_s": med([p[1] for p in pairs]),
                "floor_import_s": med([p[2] for p in pairs]), "floor_read_s": med([p[3] for p in pairs]),
                "startup_vs_floor": med([p[0] / p[1] for p in pairs]),
                "startup_vs_floor_by_order": {  # whichever starts second is faster here: hence the even count
                    "floor_first": med([p[0] / p[1] for k, p in enumerate(pairs) if k % 2 == 0]),
                    "engine_first": med([p[0] / p[1] for k, p in enumerate(pairs) if k % 2 == 1])},
                "startup_pairs": [[round(x, 3) for x in p[:2]] for p in pairs],
                "startup_cpu_s": med([p[4] for p in pairs]), "floor_cpu_s": med([p[5] for p in pairs]),
                "startup_cpu_vs_floor": med([p[4] / p[5] for p in pairs]), "build_s": med(build),
                "worker_up_s": med(up),
                "shard_bytes": shard})


def serve_disk(args, configs, spans, module, files, work, budget, order, colds=None):
    """Serve ``order`` with ``host_budget=budget``, each disk-tier load paired with ``tp x pp`` bare
    processes reading the same model's bytes at once, right before it and right after it (the geometric
    mean of the two: the disk's speed drifts); ``colds[k]``:
    the page cache dropped before each of request ``k``'s two reads (default), else warmed first. Returns
    (rows, start-up seconds): per load ``{model, tier, cold, span_s, nbytes}``, with ``gbps`` and
    ``bare_gbps`` for disk-tier loads."""
    n = args.tp * args.pp
    colds = colds or [True] * len(order)
    engine, startup = launch(args, configs, os.path.join(work, "disk"), files, host_budget=budget,
                             overlap=args.overlap)
    loaded = {}

    def spy(reply):
        if isinstance(reply, msg.Loaded):
            loaded.setdefault(reply.seq, {})[reply.rank] = reply
    engine.add_reply_observer(spy)
    rows = []

    async def drive(bare):
        async with engine:
            for k, m in enumerate(order):
                i, cold = int(m[1:]), colds[k]
                on_disk = any(m not in s.host_resident for s in engine.stats().values())
                if on_disk and not cold:
                    floor.warm_cache(files_of([configs[i].model_kwargs["path"]]))
                before, bare_gbps = set(loaded), []
                for step in ("bare", "engine", "bare") if on_disk else ("engine",):
                    if cold:
                        floor.drop_cache(files)
                    if step == "bare":
                        got = bare.read([[spans[i][r]] for r in range(n)], fresh=False)
                        bare_gbps.append(got["bytes"] / got["max_s"] / 1e9)
                    else:
                        await engine.submit(m, {"input_ids": [2, 10, 20, 30], "max_tokens": args.max_tokens})
                bare_gbps = statistics.geometric_mean(bare_gbps) if bare_gbps else None
                for seq in sorted(set(loaded) - before):
                    reps = loaded[seq].values()
                    row = {"model": m, "tier": "disk" if any(r.tier == "disk" for r in reps) else "host",
                           "cold": cold, "span_s": max(r.end - r.start for r in reps),
                           "nbytes": sum(r.nbytes for r in reps)}
                    if row["tier"] == "disk":
                        row["gbps"] = sum(r.read_bytes for r in reps) / max(r.read_s for r in reps) / 1e9
                        row["bare_gbps"] = bare_gbps
                        log(f"  {m} from disk ({'cold' if cold else 'warm'}): {row['gbps']:.2f} GB/s, bare processes "
                            f"{bare_gbps:.2f} GB/s -> {row['gbps'] / bare_gbps:.2f}; read "
                            f"{', '.join(f'{r.read_s:.3f}' for r in reps)} s, load {row['span_s']:.3f} s")
                    rows.append(row)
    with floor.BareProcesses(n, module) as bare:
        asyncio.run(drive(bare))
    return rows, startup


def disk_summary(rows) -> dict:
    disk = [r for r in rows if r["tier"] == "disk" and r.get("bare_gbps")]
    host = [r for r in rows if r["tier"] == "host"]
    return {"loads_disk": len(disk), "loads_host": len(host),
            "disk_gbps": med([r["gbps"] for r in disk]),
            "concurrent_read_gbps": med([r["bare_gbps"] for r in disk]),
            "disk_vs_concurrent_read": med([r["gbps"] / r["bare_gbps"] for r in disk]),
            "host_to_device_gbps": med([r["nbytes"] / r["span_s"] / 1e9 for r in host]),
            "swap_s_disk": med([r["span_s"] for r in disk]), "swap_s_host": med([r["span_s"] for r in host])}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.only == "beyond":
        return finish(args, {})
    paths = checkpoints(args, args.model, args.models, args.vocab)
    files = files_of(paths)
    ckpt_bytes = sum(os.path.getsize(f) for f in files)
    log(f"{len(paths)} checkpoints, {ckpt_bytes / 1e9:.2f} GB on disk; computing each rank's reads ...")
    spans = floor.rank_spans(paths, args.tp, args.pp)
    module = floor.model_module(paths[0])
    n = args.tp * args.pp
    res = {"model": args.model, "dtype": args.dtype, "models": args.models, "tp": args.tp, "pp": args.pp,
           "checkpoint_bytes": ckpt_bytes,
           "slice_bytes_per_rank": [sum(floor.slice_bytes(spans[i][r]) for i in spans) for r in range(n)],
           "span_bytes_per_rank": [sum(floor.span_bytes(spans[i][r]) for i in spans) for r in range(n)],
           "cache": "cold: posix_fadvise(POSIX_FADV_DONTNEED) of every checkpoint file before each engine start, "
                    "floor, request and paired read"}
    configs = [ModelConfig(f"m{i}", zoo.load_causal_lm, {"path": p}) for i, p in enumerate(paths)]
    work = tempfile.mkdtemp(prefix="tiers-logs-")
    try:
        if args.disk_rows:
            m = len(configs)  # each load evicts the previous model from host memory: every load from disk
            rows, _ = serve_disk(args, configs, spans, module, files, work, 1,
                                 [f"m{k % m}" for k in range(2 * args.rounds * m)],
                                 [(k // m) % 2 == 0 for k in range(2 * args.rounds * m)])
            for c in (True, False):
                part = disk_summary([r for r in rows if r["cold"] == c])
                res.update({f"{k}_{'cold' if c else 'warm'}": v for k, v in part.items()})
            res["cache"] = "each load twice: cold (page cache dropped before it and before its paired read) and warm"
        else:
            targets = {}
            if args.only in (None, "startup"):
                measure_startup(args, configs, spans, module, files, work, res)
                targets["startup_vs_floor<=1.3"] = res["startup_vs_floor"] <= 1.3
            if args.only in (None, "disk"):
                # host_models shards and half of one: a shard's bytes may exceed its slices' (buffers
                # computed, not read)
                budget = int((args.host_models + 0.5) * max(floor.slice_bytes(spans[0][r]) for r in range(n)))
                order = [f"m{i}" for _ in range(args.rounds) for i in range(args.models)]
                log(f"serving {len(order)} requests, host_budget={budget / 1e6:.0f} MB ({args.host_models} "
                    "shards) ...")
                rows, res["startup_budget_s"] = serve_disk(args, configs, spans, module, files, work, budget, order)
                res["host_budget"], res["overlap"] = budget, args.overlap
                res.update(disk_summary(rows))
                targets["disk_vs_concurrent_read>=0.9"] = res["disk_vs_concurrent_read"] >= 0.9
            res["targets"] = targets
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return finish(args, res)


def finish(args, res: dict) -> dict:
    """The beyond-memory run where asked, then the JSON line."""
    if args.beyond_memory or args.only == "beyond":
        import tiers_beyond
        work = tempfile.mkdtemp(prefix="tiers-logs-")
        try:
            res["beyond_memory"] = tiers_beyond.run(args, sys.modules[__name__], work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    res["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    out = json.loads(json.dumps(res), parse_float=lambda v: float(f"{float(v):.4g}"))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
