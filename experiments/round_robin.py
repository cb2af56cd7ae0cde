"""Round-robin client: isolates swap time (the paper's ``experiments/round_robin.py`` and its first table).

``n`` models ``m0..m{n-1}`` of one zoo shape, ``max_loaded`` of them resident
(default 1), request ``i`` goes to model ``i % n``. With ``-b`` the client
waits for each answer before sending the next, so with ``max_loaded=1`` every
request pays one offload, one load and one batch, one after the other.

Per request we record, all on the master's ``time.perf_counter`` clock:

- ``response``: client side, from just before ``submit`` to the answer;
- ``model``: master-side duration of the batch that held the request;
- ``load``: master-side duration of the load that brought the model in for
  that batch (0 when the model was already resident); a load belongs to the
  first batch of its model that ends after it;
- ``offload``: master-side durations of the offloads sent after the previous
  load and up to this load (the evictions that made room for it);
- ``busy``: the length of the union of those intervals inside the request's
  [submit, answer] window;
- ``overhead = response - busy``: time in which none of the request's own
  commands was in flight, i.e. the engine's own overhead (queueing, scheduling,
  dispatch, future resolution). When offload, load and batch run one after the
  other (blocking, max_loaded=1, paper mode) the union is their sum and this is
  exactly ``response - offload - load - model``. Without ``-b`` it also holds
  the wait behind other models' work;
- ``control``: the control-plane time hidden *inside* those records: for each
  record, (first rank start - master send) + (master receipt - last rank end).

In blocking mode "the swaps of a request" are exactly the swap records that
started between the previous request's answer and this request's answer.

The first ``n`` requests (one per model: first loads, lazy initialisation) are
warm-up and are left out of every mean.

The JSON goes to ``results/round_robin/`` (git-ignored) unless ``--out`` names
another file; the tracked ``experiments/data`` needs ``--publish``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from typing import Dict, List, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

FIELDS = ("offload", "load", "model", "response", "overhead")


def _union_len(intervals: Sequence[tuple], lo: float, hi: float) -> float:
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _control(rec) -> float:
    if not rec.rank_times:
        return 0.0
    first = min(a for a, _ in rec.rank_times.values())
    last = max(b for _, b in rec.rank_times.values())
    return max(0.0, first - rec.start) + max(0.0, rec.end - last)


def work_size(rec) -> int:
    """Requests in a batch record, or sequences in a token-level step record."""
    return rec.batch_size if rec.kind == "batch" else rec.running


def attribute(metrics: Sequence, client: Sequence[dict]) -> List[dict]:
    """Per-request records from the engine's metrics and the client's own timings (see the module doc).

    With token-level generation the model's work is a series of ``step`` records instead of one ``batch``;
    a request's ``model`` time is then the sum of its model's steps from its submit to the step that
    answered it (``RequestRecord.batch_uid`` names that step).
    """
    reqs = sorted((r for r in metrics if r.kind == "request"), key=lambda r: r.uid)
    batches = sorted((r for r in metrics if r.kind in ("batch", "step")), key=lambda r: r.start)
    swaps = sorted((r for r in metrics if r.kind in ("load", "offload")), key=lambda r: r.start)
    by_submit = sorted(client, key=lambda c: c["t_submit"])
    if len(reqs) != len(by_submit):
        raise RuntimeError(f"engine recorded {len(reqs)} requests, the client sent {len(by_submit)}")
    # which offloads make room for which load, and which batch each load served
    evictions: Dict[int, list] = {}
    load_of_batch: Dict[int, list] = {}
    pending_offloads: list = []
    for s in swaps:
        if s.kind == "offload":
            pending_offloads.append(s)
            continue
        evictions[id(s)] = pending_offloads
        pending_offloads = []
        for b in batches:
            if b.model_id == s.model_id and b.end >= s.end:
                load_of_batch.setdefault(id(b), []).append(s)
                break
    batch_of_seq = {b.seq: b for b in batches}
    out = []
    for rec, c in zip(reqs, by_submit):
        if rec.model_id != c["model"]:
            raise RuntimeError(f"request order mismatch: engine uid {rec.uid} is {rec.model_id}, "
                               f"client request {c['i']} is {c['model']}")
        b = batch_of_seq.get(rec.batch_uid) if rec.batch_uid is not None else None
        work = [] if b is None else [b] if b.kind == "batch" else [
            w for w in batches if w.kind == "step" and w.model_id == rec.model_id
            and w.start >= rec.submitted and w.end <= b.end]
        loads = [ld for w in work for ld in load_of_batch.get(id(w), [])]
        offs = [o for ld in loads for o in evictions.get(id(ld), [])]
        own = loads + offs + work
        response = c["t_answer"] - c["t_submit"]
        busy = _union_len([(r.start, r.end) for r in own], c["t_submit"], c["t_answer"])
        out.append({
            "i": c["i"], "uid": rec.uid, "model_id": rec.model_id, "ok": c["ok"], "error": c.get("error"),
            "n_tokens": c.get("n_tokens"), "batch_size": work_size(b) if b is not None else None,
            "submit": c["t_submit"], "answer": c["t_answer"],
            "response": response,
            "offload": sum(o.duration for o in offs),
            "load": sum(ld.duration for ld in loads),
            "model": sum(w.duration for w in work),
            "busy": busy,
            "overhead": response - busy,
            "control": sum(_control(r) for r in own),
            "n_loads": len(loads), "n_offloads": len(offs),
            "load_rank_s": max((max(ld.rank_durations.values(), default=0.0) for ld in loads), default=0.0),
            "offload_rank_s": max((max(o.rank_durations.values(), default=0.0) for o in offs), default=0.0),
            "model_rank_s": sum(max(w.rank_durations.values(), default=0.0) for w in work),
        })
    out.sort(key=lambda r: r["i"])
    return out


def summarize(records: Sequence[dict], warmup: int) -> dict:
    kept = [r for r in records[warmup:] if r["ok"]]
    s = {"n": len(kept), "warmup_dropped": min(warmup, len(records)),
         "errors": sum(1 for r in records if not r["ok"])}
    for f in FIELDS + ("busy", "control", "load_rank_s", "offload_rank_s", "model_rank_s"):
        s[f] = workload.mean([r[f] for r in kept])
    s["response_minus_load_model"] = workload.mean([r["response"] - r["load"] - r["model"] for r in kept])
    s["overhead_p50"] = workload.percentile([r["overhead"] for r in kept], 50)
    s["overhead_p99"] = workload.percentile([r["overhead"] for r in kept], 99)
    return s


async def _client(engine, args, prompt, mode: str) -> List[dict]:
    progress = workload.Progress(mode, args.num_requests, args.progress_every)

    async def one(i):
        mid = f"m{i % args.num_models}"
        rec = {"i": i, "model": mid, "ok": True}
        rec["t_submit"] = time.perf_counter()
        try:
            out = await engine.submit(mid, {"input_ids": prompt, "max_tokens": args.max_tokens})
            rec["n_tokens"] = int(out.numel())
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {exc}"
        rec["t_answer"] = time.perf_counter()
        progress.tick()
        return rec

    if args.blocking:
        return [await one(i) for i in range(args.num_requests)]
    tasks = [asyncio.create_task(one(i)) for i in range(args.num_requests)]
    return list(await asyncio.gather(*tasks))


def run_mode(mode: str, args) -> dict:
    engine, launch_s = workload.launch_opt(mode, args.model_name, args.num_models, args.max_loaded, args)
    load_before = os.getloadavg()
    res = asyncio.run(_drive(engine, mode, args))
    return {**res, "launch_s": launch_s, "loadavg": [load_before[0], os.getloadavg()[0]]}


async def _drive(engine, mode: str, args) -> dict:
    """The requests on ``engine`` (closed at the end)."""
    prompt = workload.make_prompt(args.model_name)
    async with engine:
        t1 = time.perf_counter()
        client = await _client(engine, args, prompt, mode)
        wall = time.perf_counter() - t1
        metrics = engine.metrics()
    return {"records": attribute(metrics, client), "engine": [workload.record_json(r) for r in metrics],
            "wall_s": wall}


def _fmt(x, unit=1.0, nd=4):
    return "-" if x is None else f"{x * unit:.{nd}f}"


RATIO_ROWS = ("offload", "load", "model", "response", "overhead", "control")
"""Rows that get a paper/ours ratio: measured times. ``resp-ld-md`` is a difference of means (it can be
negative when the load overlaps the batch), so a ratio of it means nothing and is not printed."""

ROW_HELP = ("offload/load/model: master-side time of the request's evictions, its model's load, its batch; "
            "response: submit to answer, as the client sees it; overhead: response time in which none of the "
            "request's own commands was in flight (the engine's own cost); resp-ld-md = response - load - "
            "model (negative when the load overlaps the batch); ctrl-plane: control-plane time inside those "
            "records")


def print_table(summary: dict, modes: Sequence[str], file=sys.stdout) -> None:
    warm = next(iter(summary.values()))["warmup_dropped"]
    print(f"mean milliseconds (ms) per request (first {warm} requests dropped as warm-up)", file=file)
    both = "ours" in modes and "paper" in modes
    head = f"{'':<10}" + "".join(f"{m + ' ms':>12}" for m in modes)
    if both:
        head += f"{'paper/ours':>12}"
    print(head, file=file)
    rows = list(FIELDS) + ["response_minus_load_model", "control"]
    names = {"response_minus_load_model": "resp-ld-md", "control": "ctrl-plane"}
    for f in rows:
        line = f"{names.get(f, f):<10}" + "".join(f"{_fmt(summary[m][f], unit=1e3, nd=2):>12}" for m in modes)
        if both:
            o, p = summary["ours"][f], summary["paper"][f]
            ok = f in RATIO_ROWS and o is not None and p is not None and o > 0 and p >= 0
            line += f"{p / o:>11.2f}x" if ok else f"{'-':>12}"
        print(line, file=file)
    print(ROW_HELP, file=file)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_name", nargs="?", default="opt-tiny", help="a computron.zoo shape name")
    ap.add_argument("-n", "--num-models", type=int, default=2)
    ap.add_argument("-t", "--tp-world-size", type=int, default=1)
    ap.add_argument("-p", "--pp-world-size", type=int, default=1)
    ap.add_argument("-r", "--num-requests", type=int, default=20)
    ap.add_argument("-b", "--blocking", action="store_true", help="wait for each answer before the next request")
    ap.add_argument("--max-loaded", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8, help="CausalLMBatchManager max_batch_size")
    ap.add_argument("--modes", default="ours,paper", help="comma-separated: ours, paper")
    ap.add_argument("--dtype", default=None, help="float32/float16/bfloat16 (default: float16 on GPU, else float32)")
    ap.add_argument("--progress-every", type=int, default=10, help="a progress line on stderr every N answers")
    ap.add_argument("--no-overlap", action="store_true", help="ablation: EngineConfig(overlap=False) for ours")
    ap.add_argument("--no-prefetch", action="store_true", help="ablation: EngineConfig(prefetch=False) for ours")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads per worker (EngineConfig.worker_threads; 0: automatic)")
    ap.add_argument("--out", default=None,
                    help="JSON file to write (default: results/round_robin/rr_<model>_t<tp>_p<pp>.json)")
    workload.add_publish_arg(ap)
    args = ap.parse_args(argv)
    args.out = args.out or workload.results_path(
        "round_robin", f"rr_{args.model_name}_t{args.tp_world_size}_p{args.pp_world_size}.json")
    workload.check_outputs(ap, args.publish, args.out)
    args.dtype = args.dtype or workload.default_dtype()
    try:
        modes = workload.parse_modes(args.modes)
    except ValueError as exc:
        ap.error(str(exc))
    if args.num_requests <= args.num_models:
        ap.error(f"-r {args.num_requests}: need more requests than the {args.num_models} warm-up ones")

    results, summary, extra = {}, {}, {}
    for mode in modes:
        print(f"[{mode}] launching {args.num_models} x {args.model_name} tp={args.tp_world_size} "
              f"pp={args.pp_world_size}", file=sys.stderr, flush=True)
        res = run_mode(mode, args)
        results[mode] = res["records"]
        summary[mode] = summarize(res["records"], warmup=args.num_models)
        extra[mode] = {"engine": res["engine"], "launch_s": res["launch_s"], "wall_s": res["wall_s"],
                       "loadavg_1min": res["loadavg"]}
        print(f"[{mode}] {len(res['records'])} requests in {res['wall_s']:.2f}s "
              f"(launch {res['launch_s']:.1f}s)", file=sys.stderr, flush=True)
    if "ours" in summary and "paper" in summary:
        summary["paper_over_ours"] = {f: (summary["paper"][f] / summary["ours"][f]
                                          if summary["ours"][f] else None) for f in FIELDS}
    config = {k: v for k, v in vars(args).items() if k not in ("out", "publish")}
    config.update(modes=modes, warmup_dropped=args.num_models,
                  date=datetime.datetime.now().isoformat(timespec="seconds"), machine=workload.machine_info(),
                  command=" ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])))
    doc = {"kind": "round_robin", "config": config, "records": results, "summary": summary,
           "engine_records": {m: extra[m]["engine"] for m in modes},
           "timing": {m: {k: extra[m][k] for k in ("launch_s", "wall_s", "loadavg_1min")} for m in modes}}
    workload.write_json(args.out, doc)  # first: the run is kept even if printing fails
    print(f"\n{args.model_name} x{args.num_models} tp={args.tp_world_size} pp={args.pp_world_size} "
          f"max_loaded={args.max_loaded} {'blocking' if args.blocking else 'all at once'} "
          f"r={args.num_requests} max_tokens={args.max_tokens}")
    print_table(summary, modes)
    return doc


if __name__ == "__main__":
    main()
