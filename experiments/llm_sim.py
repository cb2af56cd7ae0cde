"""LLM workloads: request-level against token-level switching, on the paper's Gamma configurations.

Each configuration of ``workload.py`` (rates per model, CV) is drawn once from ``--seed`` (rates times
``--rate-scale``) and given LLM-like requests (``workload.llm_requests``: prompts of 8-64 tokens,
lognormal output lengths, mean ``--mean-tokens``, capped at ``--max-tokens-cap``). The same requests are
replayed against every mode, each in its own engine (one per mode, model count and ``max_loaded``, reused
across configurations), every request sent with ``Engine.stream``:

- ``paper``: ``EngineConfig(paper_mode=True)``: the paper's swaps, request-level batches;
- ``request``: our swaps, request-level batches (``step_mode=False``);
- ``rtc``, ``quantum``, ``deadline``: token-level generation with that ``EngineConfig.policy``;
- ``peer``: the loader Ray Serve multiplexing users write, in this process: every model's state dict in
  host memory, one resident module, ``load_state_dict`` into it on a miss, one request at a time (greedy
  ``generate``), first come first served.

Per run: TTFT and end-to-end mean/p50/p99, SLO attainment (TTFT within ``--ttft-slo``), output tokens/s,
swaps (loads) and preemptions. ``--bisect INDEX`` finds, per mode, the sustainable rate of that
configuration: the largest rate scale (bisection over ``--bisect-steps`` runs of ``--bisect-duration`` s
between 0 and ``--bisect-hi``, every probe drawn from the same seed) at which p99 TTFT stays within the
objective (at request level the first token comes with the whole answer, so the objective must allow one
answer's generation time for that mode to sustain any rate at all); ``sustainable_rate_ratio`` is
the best token-level mode's over ``request``'s. Plots (``--plot-dir``): TTFT CDFs per configuration and
p99 TTFT against the rate scale, one line per mode.

Output: ``results/llm_sim/llm_sim_<model>.json`` and the PNGs in ``results/llm_sim/`` (git-ignored), unless
``--out`` / ``--plot-dir`` say otherwise; the tracked ``experiments/data`` and ``experiments/figures`` need
``--publish``. A trace that draws no request is refused (exit 2) before any engine starts. A quick run
(85 s on 2 CPU cores; ``experiments/README.md`` has the others):

    .venv/bin/python experiments/llm_sim.py --configs 1 --duration 20 --rate-scale 0.2 --modes request,deadline,peer
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

MODES = ("paper", "request", "rtc", "quantum", "deadline", "peer")
TOKEN_MODES = ("rtc", "quantum", "deadline")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--configs", default="0,1,4", help="indices of workload.CONFIGS ('' for a bisection alone)")
    p.add_argument("--max-loaded", default="1", help="comma-separated, e.g. 1,2")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rate-scale", type=float, default=0.1, help="multiplies every configuration's rates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-tokens", type=float, default=48.0)
    p.add_argument("--max-tokens-cap", type=int, default=256)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT objective in seconds")
    p.add_argument("--quantum-ms", type=float, default=200.0)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--bisect", type=int, default=None, help="configuration index to find sustainable rates for")
    p.add_argument("--bisect-steps", type=int, default=4)
    p.add_argument("--bisect-duration", type=float, default=20.0)
    p.add_argument("--bisect-hi", type=float, default=0.4, help="upper end of the rate-scale search")
    p.add_argument("--out", default=None, help="JSON file to write (default: results/llm_sim/llm_sim_<model>.json)")
    p.add_argument("--plot-dir", default=workload.results_path("llm_sim"), help="where the PNGs go")
    workload.add_publish_arg(p)
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Turn the comma-separated options into lists, or refuse them (exit 2) before anything runs."""
    given, args.modes = args.modes, [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes {given!r}: a comma-separated list of {MODES}")
    try:
        args.configs = [int(c) for c in args.configs.split(",") if c.strip()]
        args.max_loaded = [int(x) for x in args.max_loaded.split(",")]
    except ValueError as exc:
        p.error(f"--configs and --max-loaded take comma-separated integers ({exc})")
    for c in args.configs + ([args.bisect] if args.bisect is not None else []):
        if not 0 <= c < len(workload.CONFIGS):
            p.error(f"configuration {c}: must be in 0..{len(workload.CONFIGS) - 1}")
    if not groups(args) and args.bisect is None:
        p.error("nothing to run: give --configs with a --max-loaded below their model count, or --bisect")
    args.out = args.out or workload.results_path("llm_sim", f"llm_sim_{args.model}.json")
    workload.check_outputs(p, args.publish, args.out, args.plot_dir)


def groups(args) -> list:
    """(model count, max_loaded) of each engine the configuration runs need (swap-bound ones only)."""
    return sorted({(workload.CONFIGS[c].n_models, ml) for c in args.configs for ml in args.max_loaded
                   if ml < workload.CONFIGS[c].n_models})


def trace_for(c: int, scale: float, duration: float, args) -> list:
    """The seeded arrivals ``(time, model)`` of configuration ``c`` with its rates times ``scale``."""
    cfg = workload.CONFIGS[c]
    return workload.make_trace([r * scale for r in cfg.rates], cfg.cv, duration, args.seed,
                               [f"m{i}" for i in range(cfg.n_models)])


def requests_for(c: int, scale: float, duration: float, args) -> list:
    """LLM-like requests on ``trace_for``'s arrivals."""
    return workload.llm_requests(trace_for(c, scale, duration, args), args.model, args.seed + 1, args.mean_tokens,
                                 args.max_tokens_cap)


def refuse_empty_traces(p: argparse.ArgumentParser, args) -> None:
    """Exit 2, before any engine starts (or torch is imported), if a trace to run draws no request: each
    configuration's, and the bisection's first probe (half ``--bisect-hi``; if it draws none, so does every
    lower probe, which is where the search would go)."""
    runs = [(c, args.rate_scale, args.duration, f"configuration {c}", ("--duration", "--rate-scale"))
            for c in args.configs]
    if args.bisect is not None:
        scale = args.bisect_hi / 2
        runs.append((args.bisect, scale, args.bisect_duration, f"--bisect {args.bisect}'s first probe "
                     f"(rate scale {scale:g})", ("--bisect-duration", "--bisect-hi")))
    for c, scale, duration, label, knobs in runs:
        workload.check_trace(p, trace_for(c, scale, duration, args), label,
                             [r * scale for r in workload.CONFIGS[c].rates], duration, knobs)


# ---- the peer: one resident module, load_state_dict on a miss ----------------------------------

class MultiplexPeer:
    """What a Ray Serve ``@serve.multiplexed`` deployment of one replica does for these models."""

    def __init__(self, model_name: str, n_models: int, device: str):
        import torch
        from computron import zoo
        self.device = device
        self.state = {}
        for i in range(n_models):
            m = zoo.random_causal_lm(model_name, seed=i, fast_init=True)
            self.state[f"m{i}"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
        self.module = zoo.random_causal_lm(model_name, seed=0, fast_init=True).to(device).eval()
        self.resident = None
        self.loads = 0
        self.load_s = 0.0
        self._lock = threading.Lock()  # one request at a time
        self._torch = torch

    def _generate(self, model_id: str, data: dict, on_token) -> None:
        with self._lock:
            if self.resident != model_id:
                t0 = time.perf_counter()
                self.module.load_state_dict(self.state[model_id])
                if self.device == "cuda":
                    self._torch.cuda.synchronize()
                self.load_s += time.perf_counter() - t0
                self.loads += 1
                self.resident = model_id
            ids = self._torch.tensor([data["input_ids"]], device=self.device)
            with self._torch.inference_mode():
                out = self.module.generate(input_ids=ids, attention_mask=self._torch.ones_like(ids),
                                           max_new_tokens=data["max_tokens"], do_sample=False,
                                           pad_token_id=self.module.config.pad_token_id)
            for t in out[0, ids.shape[1]:].tolist():
                on_token(t)

    async def stream(self, model_id: str, data: dict):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        def work():
            try:
                self._generate(model_id, data, lambda t: loop.call_soon_threadsafe(q.put_nowait, t))
            finally:
                loop.call_soon_threadsafe(q.put_nowait, done)
        fut = loop.run_in_executor(None, work)
        while True:
            item = await q.get()
            if item is done:
                break
            yield item
        await fut


# ---- engines -----------------------------------------------------------------------------------

def launch(mode: str, args, n_models: int, max_loaded: int):
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    if mode == "peer":
        import torch
        return MultiplexPeer(args.model, n_models, "cuda" if torch.cuda.is_available() else "cpu")
    configs = [ModelConfig(f"m{i}", zoo.random_causal_lm,
                           {"name": args.model, "seed": i, "fast_init": True, "dtype": workload.default_dtype()})
               for i in range(n_models)]
    kw = dict(max_loaded=max_loaded, max_batch_size=args.max_batch_size, worker_threads=0)
    if mode == "paper":
        kw.update(paper_mode=True)
    elif mode == "request":
        kw.update(step_mode=False)
    else:
        kw.update(policy={"rtc": "run_to_completion"}.get(mode, mode), quantum_ms=args.quantum_ms,
                  ttft_slo_s=args.ttft_slo)
    return LaunchEngine(EngineConfig(**kw), configs, args.tp, args.pp)


def counts(engine) -> Dict[str, int]:
    if isinstance(engine, MultiplexPeer):
        return {"loads": engine.loads, "preemptions": 0}
    c = engine.counters()
    return {"loads": sum(n for (m, k), n in c["swaps"].items() if k == "load"),
            "preemptions": sum(c["preemptions"].values())}


def run_trace(engine, requests, label: str, slo: float) -> dict:
    async def go():
        before = counts(engine)
        results = await workload.replay_stream(engine.stream, requests, label, progress_every=20)
        after = counts(engine)
        return results, {k: after[k] - before[k] for k in after}
    results, delta = asyncio.run(go())
    summary = workload.summarize_llm(results, slo)
    summary.update(delta)
    summary["ttfts"] = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    print(f"[{label}] " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in summary.items() if k != "ttfts" and v is not None),
          file=sys.stderr, flush=True)
    return summary


def warm_up(engine, n_models: int) -> None:
    async def go():
        for i in range(n_models):
            async for _ in engine.stream(f"m{i}", {"input_ids": [2, 5], "max_tokens": 1}):
                pass
    asyncio.run(go())


def close(engine) -> None:
    if not isinstance(engine, MultiplexPeer):
        engine.close()


def bisect_rate(engine, args, label: str) -> dict:
    """Largest rate scale with p99 TTFT within the objective (0 if even the lowest probe misses it)."""
    lo, hi, probes = 0.0, args.bisect_hi, []
    for step in range(args.bisect_steps):
        scale = (lo + hi) / 2
        reqs = requests_for(args.bisect, scale, args.bisect_duration, args)
        s = run_trace(engine, reqs, f"{label} x{scale:.3f}", args.ttft_slo)
        ok = s["errors"] == 0 and s["ttft_p99"] is not None and s["ttft_p99"] <= args.ttft_slo
        probes.append({"scale": scale, "ttft_p99": s["ttft_p99"], "ok": ok, "requests": s["requests"]})
        lo, hi = (scale, hi) if ok else (lo, scale)
    return {"sustainable_scale": lo, "probes": probes}


@contextlib.contextmanager
def warm_engine(mode: str, args, n_models: int, max_loaded: int):
    engine = launch(mode, args, n_models, max_loaded)
    try:
        warm_up(engine, n_models)
        yield engine
    finally:
        close(engine)


def run_configs(args, requests: Dict[int, list]) -> List[dict]:
    """Every configuration's requests against every mode, one engine per (mode, model count, max_loaded)."""
    runs = []
    for n_models, ml in groups(args):
        for mode in args.modes:
            with warm_engine(mode, args, n_models, ml) as engine:
                for c in args.configs:
                    if workload.CONFIGS[c].n_models == n_models:
                        s = run_trace(engine, requests[c], f"c{c} ml{ml} {mode}", args.ttft_slo)
                        runs.append({"config": c, "max_loaded": ml, "mode": mode, **s})
    return runs


def run_bisect(args) -> dict:
    """The sustainable rate of ``--bisect``'s configuration per mode, and the best token level's over request's."""
    n_models, ml = workload.CONFIGS[args.bisect].n_models, min(args.max_loaded)
    out = {"bisect": {"config": args.bisect, "max_loaded": ml, "modes": {}}}
    for mode in args.modes:
        with warm_engine(mode, args, n_models, ml) as engine:
            out["bisect"]["modes"][mode] = bisect_rate(engine, args, f"bisect c{args.bisect} {mode}")
    rates = {m: b["sustainable_scale"] for m, b in out["bisect"]["modes"].items()}
    token = [m for m in TOKEN_MODES if m in rates]
    out["sustainable_rate_ratio"] = None  # without both sides, or when request level sustains no rate
    if token:
        best = max(token, key=lambda m: rates[m])
        out["best_token_mode"] = best
        if rates.get("request"):
            out["sustainable_rate_ratio"] = rates[best] / rates["request"]
    return out


def ttft_ratios(args, runs: List[dict]) -> Dict[str, float]:
    """Per swap-bound run: the best token-level p99 TTFT over request level's."""
    ratios = {}
    for c in args.configs:
        for ml in args.max_loaded:
            by = {r["mode"]: r for r in runs if r["config"] == c and r["max_loaded"] == ml}
            tok = [by[m]["ttft_p99"] for m in TOKEN_MODES if m in by and by[m]["ttft_p99"] is not None]
            if tok and by.get("request", {}).get("ttft_p99"):
                ratios[f"c{c}_ml{ml}"] = min(tok) / by["request"]["ttft_p99"]
    return ratios


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    refuse_empty_traces(p, args)
    requests = {c: requests_for(c, args.rate_scale, args.duration, args) for c in args.configs}
    doc = {"experiment": "llm_sim", "model": args.model, "rate_scale": args.rate_scale, "duration_s": args.duration,
           "ttft_slo_s": args.ttft_slo, "quantum_ms": args.quantum_ms, "mean_tokens": args.mean_tokens,
           "tp": args.tp, "pp": args.pp, "machine": workload.machine_info(),
           "labels": {str(c): workload.CONFIGS[c].label() for c in set(args.configs) | {args.bisect or 0}}}
    doc["runs"] = run_configs(args, requests)
    if args.bisect is not None:
        doc.update(run_bisect(args))
    doc["ttft_p99_ratio"] = ttft_ratios(args, doc["runs"])
    workload.write_json(args.out, doc)
    import plot  # matplotlib
    for path in plot.plot_llm(doc, args.plot_dir):
        print(f"wrote {path}", file=sys.stderr)
    print(workload.json.dumps({k: v for k, v in doc.items() if k not in ("runs", "machine")}
                              | {"runs": [{k: v for k, v in r.items() if k != "ttfts"} for r in doc["runs"]]}))
    return doc


if __name__ == "__main__":
    main()
