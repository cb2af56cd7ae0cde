"""Tiers benchmark: shards read straight from checkpoints, and a disk tier below host memory.

Prints exactly one JSON line on stdout; progress goes to stderr.

``--models`` random-weight checkpoints (``zoo.save_random_causal_lm``, safetensors) are written to
``--dir`` (kept between runs), and served at TP=``--tp`` with ``max_loaded=1``. Measured in one run:

- start-up (``LaunchEngine`` until every worker is ready), four times: ``full`` (every rank builds every
  full model: a ``model_fn`` the engine cannot read slice-wise, ``from_pretrained`` and cut down, as
  before this change) and ``sliced`` (each rank reads only its slices, every shard kept in host
  memory), each with the page cache dropped (``cold``) and warm: ``startup_{full,sliced}_{cold,warm}_s``;
  ``build_*_s``: the part spent building models and reading their shards (slowest rank, from the
  workers' "built all" log lines; the rest is process start and imports; the first model also pays
  the import of its transformers class); ``startup_cpu_*_s``: CPU seconds (user + system) the worker
  processes used until ready (where they exceed cores x seconds, start-up is CPU-bound and its time
  cannot drop below their sum / cores). ``startup_s`` / ``startup_full_s`` are the cold ones,
  ``startup_speedup = startup_full_s / startup_s``; ``*_speedup_{cold,warm}`` likewise
  (``startup_cpu_speedup_*``: of the CPU seconds).
  ``startup_budget_s``: sliced, cold, with ``host_budget`` = ``--host-models`` shards (the rest stay on disk).
- ``read_limit_gbps``: the raw read of the same files in the same run, the better of one sequential
  stream (``read_seq_gbps``) and ``--tp`` concurrent streams over alternate files (``read_parallel_gbps``):
  per file ``posix_fadvise(POSIX_FADV_DONTNEED)`` first (drops its clean cached pages; no root
  needed; not O_DIRECT), then buffered 64 MB ``readinto``; bytes / time.
- the budgeted engine serves ``--rounds`` round robins over all models (every load beyond the
  budget's models comes from disk, host LRU), then ``--hot`` alternations of two models (from host
  memory after their first read); the page cache is dropped before each request. From each rank's
  ``Loaded`` reply: ``disk_gbps`` (median over disk-tier loads of the bytes all ranks read / the
  slowest rank's read seconds; the bytes of the slices, not the rows read around a dim-1 slice),
  ``disk_vs_read_limit``: median over disk-tier loads of that load's GB/s / the raw read of the same
  model's files measured just before its request (``read_limit_paired_gbps``: the better of one stream
  and ``--tp`` streams over equal parts; the disk here is shared and its speed drifts by 3x within
  minutes, so only paired measurements compare), ``disk_vs_read_limit_global`` against the run-wide
  ``read_limit_gbps``; ``reader_only_gbps`` / ``reader_only_vs_read_limit``: the checkpoint reader
  alone after the engine is gone (whole models, no overlapping copy), paired the same way;
  ``host_to_device_gbps`` (median over host-tier loads of all ranks' bytes / the slowest rank's load
  seconds) against ``copy_limit_gbps`` (``--tp`` threads each ``copy_`` one shard into preallocated
  memory at once, median of 5: the device is host memory on CPU), ``h2d_vs_limit``;
  ``swap_s_host`` / ``swap_s_disk``: median load seconds (slowest rank) per tier.
- ``targets``: disk_vs_read_limit >= 0.8, startup_speedup >= 3.

    .venv/bin/python benchmarks/tiers.py                       # 8 x opt-125m (vocab 512) fp16, ~2 min
    .venv/bin/python benchmarks/tiers.py --model opt-small --dtype float32    # a smoke run
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]  # benchmarks/http.py is not stdlib http

import argparse  # noqa: E402
import asyncio  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo  # noqa: E402
from computron import messages as msg  # noqa: E402


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def load_full(path: str, dtype=None):
    """The full-model path: a model_fn the engine does not recognise, so every rank builds it whole."""
    return zoo.load_causal_lm(path, dtype)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape (random weights)")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--host-models", type=int, default=3, help="host_budget in shards of one model")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hot", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "computron-tiers"))
    p.add_argument("--skip-full", action="store_true", help="do not measure the full-model start-up")
    return p.parse_args(argv)


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_gbps(files) -> float:
    drop_cache(files)
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(mv)
                if not n:
                    break
                total += n
    return total / (time.perf_counter() - t0) / 1e9


def run_threads(fn, k: int) -> float:
    """Seconds for ``fn(0)``, ..., ``fn(k - 1)`` run on ``k`` threads at once."""
    t0 = time.perf_counter()
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def raw_read_parallel_gbps(files, streams: int) -> float:
    """The same raw read with ``streams`` threads at once, each reading its own files (the ranks of a
    machine read concurrently: a single sequential stream leaves a virtual or NVMe disk's queue short)."""
    drop_cache(files)
    total = [0] * streams

    def one(i):
        mv = memoryview(bytearray(64 << 20))
        for f in files[i::streams]:
            with open(f, "rb", buffering=0) as fh:
                while True:
                    n = fh.readinto(mv)
                    if not n:
                        break
                    total[i] += n
    dt = run_threads(one, streams)
    return sum(total) / dt / 1e9


def raw_read_file_gbps(path_files, streams: int) -> float:
    """Raw read of one model's files right before its load: the better of one stream and ``streams``
    concurrent streams over equal parts of each file; the page cache is dropped before and after."""
    best = 0.0
    for k in sorted({1, streams}):
        drop_cache(path_files)
        total = [0] * k

        def one(i):
            mv = memoryview(bytearray(16 << 20))
            for f in path_files:
                size = os.path.getsize(f)
                a, b = size * i // k, size * (i + 1) // k
                fd = os.open(f, os.O_RDONLY)
                try:
                    while a < b:
                        n = os.preadv(fd, [mv[:min(len(mv), b - a)]], a)
                        if n <= 0:
                            break
                        a += n
                        total[i] += n
                finally:
                    os.close(fd)
        dt = run_threads(one, k)
        best = max(best, sum(total) / dt / 1e9)
    drop_cache(path_files)
    return best


def reader_only(paths, n: int = 4):
    """Our checkpoint reader alone (no engine, no overlapping copy), one whole model per read (TP=1:
    every tensor a contiguous run), paired with the raw read of the same files just before it.
    Returns (median GB/s, median ratio to the paired raw read)."""
    from computron import checkpoint as ck
    from computron.slice_reads import read_segments
    from computron.models import StageContext, make_runner
    from computron.store import ShardStore
    from computron.topology import Layout

    class _Groups:  # what a TP=1, PP=1 runner reads of topology.Groups
        layout, rank, stage, tp_rank = Layout(1, 1, 1, False), 0, 0, 0
    gbps, ratios = [], []
    for p in paths[:n]:
        module, names = ck.meta_model(p)
        runner = make_runner(module, ModelConfig("r", zoo.load_causal_lm, {"path": p}),
                             StageContext(_Groups(), torch.device("cpu"), "r"))
        store = ShardStore(runner.module, runner.segments, "cpu",
                           source=ck.CheckpointSource("r", p, names, runner.module), keep_host=False)
        host = store.alloc_host()
        files = sorted(glob.glob(os.path.join(p, "*.safetensors")))
        for h in host.values():
            h.zero_()  # fault the pages in first, as a reused host buffer is
        raw = raw_read_file_gbps(files, 1)
        dt, nbytes = read_segments(store.source, store.slots, host, n_segments=store.n_segments)
        gbps.append(nbytes / dt / 1e9)
        ratios.append(gbps[-1] / raw)
        drop_cache(files)
    return statistics.median(gbps), statistics.median(ratios)


def copy_limit_gbps(nbytes: int, tp: int, threads: int) -> float:
    """``tp`` concurrent copy_ of one shard each into preallocated memory; aggregate GB/s, median of 5."""
    torch.set_num_threads(threads)
    src = [torch.ones(nbytes // 4) for _ in range(tp)]
    dst = [torch.zeros(nbytes // 4) for _ in range(tp)]
    out = []
    for _ in range(5):
        spans = [None] * tp

        def one(i):
            t0 = time.perf_counter()
            dst[i].copy_(src[i])
            spans[i] = (t0, time.perf_counter())
        ts = [threading.Thread(target=one, args=(i,)) for i in range(tp)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out.append(tp * (nbytes // 4) * 4 / (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e9)
    return statistics.median(out)


def build_seconds(log_dir: str) -> float:
    """Model-building seconds of the slowest rank (its shards read too), from the workers'
    'built all N models in X s' log lines; the rest of start-up is process start and imports."""
    per_rank = []
    for f in glob.glob(os.path.join(log_dir, "worker_*.log")):
        with open(f) as fh:
            per_rank += [float(m) for m in re.findall(r" built all \d+ models in ([0-9.]+)s", fh.read())]
    return max(per_rank) if per_rank else float("nan")


def workers_cpu_s() -> float:
    """CPU seconds (user + system) the processes this one started have used so far."""
    import psutil
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def launch(configs, tp, log_dir, files, **cfg):
    drop_cache(files)
    shutil.rmtree(log_dir, ignore_errors=True)
    t0 = time.perf_counter()
    engine = LaunchEngine(EngineConfig(max_loaded=1, log_dir=log_dir, start_timeout_s=1800, **cfg), configs, tp, 1)
    return engine, time.perf_counter() - t0


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    paths = []
    for i in range(args.models):
        p = os.path.join(args.dir, f"{args.model}-v{args.vocab}-{args.dtype}-seed{i}")
        if not os.path.isfile(os.path.join(p, "config.json")):
            log(f"writing checkpoint {p} ...")
        paths.append(zoo.save_random_causal_lm(args.model, p, seed=i, dtype=args.dtype, vocab_size=args.vocab))
    files = [f for p in paths for f in sorted(glob.glob(os.path.join(p, "*.safetensors")))]
    ckpt_bytes = sum(os.path.getsize(f) for f in files)
    log(f"{len(paths)} checkpoints, {ckpt_bytes / 1e9:.2f} GB on disk")
    read_seq = raw_read_gbps(files)
    read_par = raw_read_parallel_gbps(files, args.tp)
    read_limit = max(read_seq, read_par)
    log(f"raw read (buffered, after POSIX_FADV_DONTNEED): {read_seq:.2f} GB/s one stream, "
        f"{read_par:.2f} GB/s {args.tp} streams")
    work = tempfile.mkdtemp(prefix="tiers-logs-")
    res = {"model": args.model, "dtype": args.dtype, "models": args.models, "tp": args.tp,
           "checkpoint_bytes": ckpt_bytes, "read_limit_gbps": read_limit, "read_seq_gbps": read_seq,
           "read_parallel_gbps": read_par,
           "read_limit_method": "buffered 64 MB readinto after posix_fadvise(POSIX_FADV_DONTNEED) per file; "
                                "the better of one stream and tp streams"}
    sliced = [ModelConfig(f"m{i}", zoo.load_causal_lm, {"path": p}) for i, p in enumerate(paths)]

    def startup(key, configs, cold=True):
        name = f"{key}_{'cold' if cold else 'warm'}"
        log(f"start-up: {key} ({'page cache dropped' if cold else 'page cache warm'}) ...")
        engine, res[f"startup_{name}_s"] = launch(configs, args.tp, os.path.join(work, name), files if cold else [])
        res[f"startup_cpu_{name}_s"] = workers_cpu_s()
        shard = max(max(w.host_bytes.values()) for w in engine.workers.values())
        engine.close()
        res[f"build_{name}_s"] = build_seconds(os.path.join(work, name))
        log(f"  {res[f'startup_{name}_s']:.1f}s (building {res[f'build_{name}_s']:.1f}s; "
            f"{res[f'startup_cpu_{name}_s']:.1f} CPU seconds in the workers)")
        return shard

    full = [ModelConfig(f"m{i}", load_full, {"path": p}) for i, p in enumerate(paths)]
    if not args.skip_full:
        startup("full", full)
    shard = startup("sliced", sliced)
    if not args.skip_full:
        startup("full", full, cold=False)
    startup("sliced", sliced, cold=False)
    res["startup_s"] = res["startup_sliced_cold_s"]
    if not args.skip_full:
        res["startup_full_s"] = res["startup_full_cold_s"]

    budget = args.host_models * shard
    res["host_budget"] = budget
    res["shard_bytes"] = shard
    log(f"start-up, slices, host_budget={budget / 1e6:.0f} MB ({args.host_models} shards) ...")
    engine, res["startup_budget_s"] = launch(sliced, args.tp, os.path.join(work, "budget"), files,
                                             host_budget=budget)
    res["build_budget_s"] = build_seconds(os.path.join(work, "budget"))
    loaded = {}  # seq -> {rank: Loaded}
    def spy(reply):
        if isinstance(reply, msg.Loaded):
            loaded.setdefault(reply.seq, {})[reply.rank] = reply
    engine.add_reply_observer(spy)
    order = [f"m{i}" for _ in range(args.rounds) for i in range(args.models)] + ["m0", "m1"] * args.hot

    model_files = {f"m{i}": sorted(glob.glob(os.path.join(p, "*.safetensors"))) for i, p in enumerate(paths)}
    paired = []  # raw read GB/s of the requested model's files, measured right before its request

    async def drive():
        async with engine:
            for m in order:
                drop_cache(files)
                paired.append(raw_read_file_gbps(model_files[m], args.tp))
                await engine.submit(m, {"input_ids": [2, 10, 20, 30], "max_tokens": args.max_tokens})
            return {r: s.host_resident for r, s in engine.stats().items()}
    t0 = time.perf_counter()
    host_resident = asyncio.run(drive())
    log(f"served {len(order)} requests in {time.perf_counter() - t0:.1f}s; host-resident at the end: {host_resident}")
    disk, host, ratios = [], [], []
    assert len(loaded) == len(order), (len(loaded), len(order))  # every request loads its model
    for i, seq in enumerate(sorted(loaded)):
        reps = loaded[seq]
        if len(reps) < args.tp:
            continue
        span = max(r.end - r.start for r in reps.values())
        if any(r.tier == "disk" for r in reps.values()):
            read_s = max(r.read_s for r in reps.values())
            gbps = sum(r.read_bytes for r in reps.values()) / read_s / 1e9
            disk.append((span, gbps))
            ratios.append(gbps / paired[i])
        else:
            host.append((span, sum(r.nbytes for r in reps.values()) / span / 1e9))
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    threads = max(1, ((os.cpu_count() or 2) - 1) // args.tp)
    limit = copy_limit_gbps(shard, args.tp, threads)
    res.update({
        "loads_disk": len(disk), "loads_host": len(host),
        "disk_gbps": med([g for _, g in disk]),
        "host_to_device_gbps": med([g for _, g in host]),
        "copy_limit_gbps": limit,
        "swap_s_disk": med([s for s, _ in disk]),
        "swap_s_host": med([s for s, _ in host]),
    })
    res["reader_only_gbps"], res["reader_only_vs_read_limit"] = reader_only(paths)
    res["disk_vs_read_limit"] = med(ratios)
    res["disk_vs_read_limit_global"] = res["disk_gbps"] / read_limit
    res["read_limit_paired_gbps"] = med([paired[i] for i, seq in enumerate(sorted(loaded))
                                         if any(r.tier == "disk" for r in loaded[seq].values())])
    res["h2d_vs_limit"] = res["host_to_device_gbps"] / limit
    if "startup_full_s" in res:
        res["startup_speedup"] = res["startup_full_s"] / res["startup_s"]
        for c in ("cold", "warm"):
            res[f"startup_speedup_{c}"] = res[f"startup_full_{c}_s"] / res[f"startup_sliced_{c}_s"]
            res[f"build_speedup_{c}"] = res[f"build_full_{c}_s"] / res[f"build_sliced_{c}_s"]
            res[f"startup_cpu_speedup_{c}"] = res[f"startup_cpu_full_{c}_s"] / res[f"startup_cpu_sliced_{c}_s"]
    res["targets"] = {"disk_vs_read_limit>=0.8": res["disk_vs_read_limit"] >= 0.8,
                      "startup_speedup>=3": res.get("startup_speedup", 0) >= 3}
    res["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__}
    shutil.rmtree(work, ignore_errors=True)
    out = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in res.items()}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
