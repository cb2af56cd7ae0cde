"""``tiers.py --beyond-memory``: serving checkpoints whose total exceeds the machine's memory.

``--beyond-models`` checkpoints of ``--beyond-model`` (default 10 x opt-1.3b fp16, 26 GB: more than this
24 GB machine has at all) are written once to ``--dir``, with each one's greedy answer to its own prompt
from transformers' ``generate`` (``reference.json`` beside the checkpoints: computed once, one model at a
time in a child process, so no process here ever holds more than one model). The engine serves them at
TP x PP with ``max_loaded=1`` and ``host_budget`` = ``--beyond-host-models`` shards, ``--beyond-rounds``
round robins, the page cache of every checkpoint dropped before each request. Reported: every load per
model (its tier and, from disk, GB/s: slice bytes of all ranks / the slowest rank's read seconds), whether
every answer equals the reference, and the peak RSS (``VmHWM``) of the master (this process, its peak
reset first through ``/proc/self/clear_refs``) and of every worker against its budget + 1 GiB: a worker's
budget is ``host_budget`` plus, on CPU where the device is host memory, ``max_loaded`` shards; the
master's is 0.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import time
from typing import Dict

GIB = 1 << 30
MAX_TOKENS = 4


def _prompt(i: int):
    return [2, 100 + 7 * i, 200 + 3 * i, 31, 400 + i]


def _reference_child(jobs, conn) -> None:
    try:
        from computron import zoo
        out = {}
        for path, prompt in jobs:
            model = zoo.load_causal_lm(path)
            out[path] = zoo.reference_generate(model, prompt, MAX_TOKENS).tolist()
            del model
            gc.collect()
        conn.send(out)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(exc)


def references(paths, directory: str, log) -> Dict[str, list]:
    """Each checkpoint's greedy answer to its prompt, from ``reference.json`` in ``directory`` where known."""
    import tiers_floor as floor
    file = os.path.join(directory, "reference.json")
    known = {}
    if os.path.isfile(file):
        with open(file) as f:
            known = json.load(f)
    key = lambda i, p: f"{os.path.basename(p)}|{_prompt(i)}|{MAX_TOKENS}"  # noqa: E731
    missing = [(p, _prompt(i)) for i, p in enumerate(paths) if key(i, p) not in known]
    if missing:
        log(f"computing {len(missing)} reference answer(s) with transformers, one model at a time ...")
        got = floor._in_child(_reference_child, missing)
        for i, p in enumerate(paths):
            if p in got:
                known[key(i, p)] = got[p]
        tmp = file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(known, f, indent=0)
        os.replace(tmp, file)
    return {f"m{i}": known[key(i, p)] for i, p in enumerate(paths)}


def meminfo() -> Dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def peak_rss(pid="self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run(args, bench, work: str) -> dict:
    """The beyond-memory run (see the module docstring); ``bench``: the ``tiers`` module (its helpers)."""
    import tiers_floor as floor
    from computron import ModelConfig, zoo
    checkpoints, files_of, launch, log, med = bench.checkpoints, bench.files_of, bench.launch, bench.log, bench.med
    from computron.comm import messages as msg
    paths = checkpoints(args, args.beyond_model, args.beyond_models, args.beyond_vocab)
    files = files_of(paths)
    total = sum(os.path.getsize(f) for f in files)
    refs = references(paths, args.dir, log)
    n = args.tp * args.pp
    one = floor.rank_spans(paths[:1], args.tp, args.pp)[0]  # the models share one shape
    shard = max(floor.slice_bytes(one[r]) for r in range(n))
    budget = int(args.beyond_host_models * shard * 1.01)  # a shard's bytes may exceed its slices' (tiers.py)
    mem = meminfo()
    res = {"model": args.beyond_model, "models": len(paths), "checkpoint_bytes": total,
           "mem_total_bytes": mem["MemTotal"], "mem_available_bytes": mem["MemAvailable"],
           "exceeds_memory": total > mem["MemAvailable"], "exceeds_total_memory": total > mem["MemTotal"],
           "host_budget": budget, "shard_bytes": shard}
    log(f"beyond memory: {len(paths)} x {args.beyond_model} = {total / 1e9:.1f} GB of checkpoints, "
        f"{mem['MemAvailable'] / 1e9:.1f} GB available of {mem['MemTotal'] / 1e9:.1f} GB; "
        f"host_budget {budget / 1e9:.2f} GB per rank")
    configs = [ModelConfig(f"m{i}", zoo.load_causal_lm, {"path": p}) for i, p in enumerate(paths)]
    res["master_peak_reset"] = reset_peak_rss()
    # a forward of an fp16 opt-1.3b on a busy 2-core CPU can keep a rank in one step for seconds: this run
    # measures memory, not liveness
    engine, res["startup_s"] = launch(args, configs, os.path.join(work, "beyond"), files, host_budget=budget,
                                      heartbeat_timeout_s=300.0)
    loads, wrong = [], []

    def spy(reply):
        if isinstance(reply, msg.Loaded):
            loads.append(reply)
    engine.add_reply_observer(spy)
    order = [f"m{i}" for _ in range(args.beyond_rounds) for i in range(len(paths))]

    async def drive():
        async with engine:
            for m in order:
                floor.drop_cache(files)
                out = await engine.submit(m, {"input_ids": _prompt(int(m[1:])), "max_tokens": MAX_TOKENS})
                if out.tolist() != refs[m]:
                    wrong.append({"model": m, "got": out.tolist(), "want": refs[m]})
            return {r: peak_rss(w.pid) for r, w in engine.workers.items()}
    t0 = time.perf_counter()
    workers = asyncio.run(drive())
    res["served_s"] = time.perf_counter() - t0
    master = peak_rss()
    device = 0 if (args.device or ("cuda" if _cuda() else "cpu")) == "cuda" else shard  # max_loaded=1
    limits = {"master": GIB, **{f"rank{r}": budget + device + GIB for r in workers}}
    peaks = {"master": master, **{f"rank{r}": v for r, v in workers.items()}}
    by_seq: Dict[int, list] = {}
    for r in loads:
        by_seq.setdefault(r.seq, []).append(r)
    per_model: Dict[str, dict] = {}
    for seq in sorted(by_seq):
        reps = by_seq[seq]
        m = reps[0].model_id
        d = per_model.setdefault(m, {"loads": 0, "tiers": [], "gbps": []})
        d["loads"] += 1
        disk = any(r.tier == "disk" for r in reps)
        d["tiers"].append("disk" if disk else "host")
        if disk:
            d["gbps"].append(round(sum(r.read_bytes for r in reps) / max(r.read_s for r in reps) / 1e9, 3))
    disk_gbps = [g for d in per_model.values() for g in d["gbps"]]
    res.update({"requests": len(order), "wrong": wrong, "all_correct": not wrong and len(order) > 0,
                "per_model": per_model, "loads_disk": len(disk_gbps), "disk_gbps": med(disk_gbps),
                "disk_gbps_min": min(disk_gbps, default=float("nan")),
                "peak_rss_bytes": peaks, "rss_limit_bytes": limits,
                "rss_ok": all(peaks[k] <= limits[k] for k in peaks)})
    res["passed"] = res["all_correct"] and res["rss_ok"] and res["exceeds_memory"]
    log(f"beyond memory: {len(order)} requests in {res['served_s']:.1f}s, all correct: {res['all_correct']}, "
        f"peak RSS {', '.join(f'{k} {v / 1e9:.2f}/{limits[k] / 1e9:.2f} GB' for k, v in peaks.items())}, "
        f"disk loads {statistics.median(disk_gbps) if disk_gbps else float('nan'):.2f} GB/s median")
    return res


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
