"""The attention backends over the paged KV pool (``models/attention.py``), on a CPU: one JSON line.

One attention layer of a SmolLM2-135M-shaped model (9 query heads on 3 KV heads of 64, float32) read as a
paged model's layers read it (``PagedKV.prepare`` once per step, then the layer's ``update`` and its
attention function, ``--layers`` times per step), at ``--threads`` intra-op threads (a worker's, 1 here):

- decode: ``--batch`` sequences at ``--context`` tokens, one new token each; bytes allocated inside the
  layer's update + attention (torch's profiler) for ``paged`` and ``gathered``, beside the step's new keys
  and values plus its output (the floor for a backend that reads the pool in place), and the step's time
  for ``paged``, ``gathered`` and ``cpu_paged`` (the C kernel, where it builds);
- mixed: the same decode step with one ``--chunk``-token prompt chunk in the same ragged row, against the
  decode step alone plus the chunk's prefill alone; ``gathered`` (today's dense ``[T, S]`` mask) reported as
  the before;
- short: a decode step at ``--short-batch`` x ``--short-context`` (this project's test and peer sizes);
- compile_s: the first ``paged`` calls of the process (FlexAttention compiled by inductor; cached on disk
  by inductor afterwards, so a second run is faster).

Times are medians of ``--repeats`` runs, the backends alternating (A B A B). Run:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/attention.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

HEADS, KV_HEADS, DIM = 9, 3, 64


def _config():
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    config._attn_implementation = "sdpa"
    return config


class _Layer(torch.nn.Module):
    """What an attention function reads of its layer."""

    def __init__(self, config):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, 0, True
        self.num_key_value_groups = HEADS // KV_HEADS


def _pool(config, backend: str, lengths, block_size: int):
    """A PagedKV whose sequences ``0..`` already hold ``lengths`` tokens (random keys and values)."""
    from computron.models.kv_pool import PagedKV
    blocks = sum(-(-(n + 1) // block_size) for n in lengths) + 64
    kv = PagedKV(config, block_size=block_size, initial_blocks=blocks)
    kv.backend = backend
    gen = torch.Generator().manual_seed(0)
    slots = blocks * block_size
    kv.keys[0], kv.values[0] = (torch.randn(KV_HEADS, slots, DIM, generator=gen) for _ in range(2))
    for sid, n in enumerate(lengths):
        kv.tables.append(sid, n)
    return kv


class _Step:
    """One prepared step of a backend: ``run`` is its attention over ``layers`` layers."""

    def __init__(self, config, backend: str, lengths, counts, block_size: int, layers: int):
        from computron.models import attention
        config = _config()  # each backend installs itself in its model's config
        self.kv = _pool(config, backend, lengths, block_size)
        self.backend, self.layers, self.layer = backend, layers, _Layer(config)
        self.counts = counts
        self.mask = self.kv.prepare([(sid, c) for sid, c in enumerate(counts)], torch.device("cpu"), torch.float32)
        self.prepare_s = self.time_prepare(config, lengths, block_size)
        gen = torch.Generator().manual_seed(1)
        b, n = (len(counts), 1) if self.kv.batched else (1, sum(counts))
        self.q = torch.randn(b, HEADS, n, DIM, generator=gen)
        self.k, self.v = (torch.randn(b, KV_HEADS, n, DIM, generator=gen) for _ in range(2))
        model = torch.nn.Module()
        model.config = config
        attention.install(model, backend)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self.fn = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]

    def time_prepare(self, config, lengths, block_size: int, repeats: int = 3) -> float:
        """The median time of ``PagedKV.prepare`` for this step (each on a fresh pool: it reserves slots)."""
        times = []
        for _ in range(repeats):
            kv = _pool(config, self.backend, lengths, block_size)
            t0 = time.perf_counter()
            kv.prepare([(sid, c) for sid, c in enumerate(self.counts)], torch.device("cpu"), torch.float32)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def layer_call(self):
        key, value = self.kv.update(self.k, self.v, 0)
        return self.fn(self.layer, self.q, key, value, self.mask, scaling=DIM ** -0.5,
                       **self.kv.forward_kwargs())[0]

    def run(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.layers):
            self.layer_call()
        return time.perf_counter() - t0

    def allocated(self) -> int:
        """Bytes allocated by one layer's update + attention (the profiler's CPU memory events: every
        allocation, freed or not, counted once)."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.layer_call()
        return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)

    def new_and_out_bytes(self) -> int:
        return (self.k.numel() + self.v.numel() + self.q.numel()) * 4


def _alternating(steps, repeats: int):
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(step.run())
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--short-batch", type=int, default=8)
    ap.add_argument("--short-context", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = _config()
    from computron.kernels.cpu import attention as cpu_attention
    ctx, b, bs, layers = args.context, args.batch, args.block_size, args.layers
    decode_lengths, decode_counts = [ctx - 1] * b, [1] * b
    mixed_lengths, mixed_counts = decode_lengths + [0], decode_counts + [args.chunk]
    out = {"bench": "attention", "threads": args.threads, "layers": layers, "batch": b, "context": ctx,
           "chunk": args.chunk, "block_size": bs, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM}
    with torch.inference_mode():
        t0 = time.perf_counter()
        paged = {"decode": _Step(config, "paged", decode_lengths, decode_counts, bs, 1)}
        paged["decode"].layer_call()
        t1 = time.perf_counter()
        paged["chunk"] = _Step(config, "paged", [0], [args.chunk], bs, 1)
        paged["chunk"].layer_call()
        t2 = time.perf_counter()
        paged["mixed"] = _Step(config, "paged", mixed_lengths, mixed_counts, bs, 1)
        paged["mixed"].layer_call()
        out["compile_s"] = {"decode": round(t1 - t0, 2), "prefill": round(t2 - t1, 2),
                            "mixed": round(time.perf_counter() - t2, 2)}
        gathered = {"decode": _Step(config, "gathered", decode_lengths, decode_counts, bs, 1),
                    "chunk": _Step(config, "gathered", [0], [args.chunk], bs, 1),
                    "mixed": _Step(config, "gathered", mixed_lengths, mixed_counts, bs, 1)}
        for steps in (paged, gathered):
            for s in steps.values():
                s.layers = layers
        floor = paged["decode"].new_and_out_bytes()
        out["decode_bytes"] = {"paged": paged["decode"].allocated(), "gathered": gathered["decode"].allocated(),
                               "new_kv_plus_output": floor}
        out["decode_bytes"]["paged_over_floor"] = round(out["decode_bytes"]["paged"] / floor, 3)
        out["decode_bytes"]["gathered_over_floor"] = round(out["decode_bytes"]["gathered"] / floor, 3)
        steps = {f"{n}_{k}": s for n, group in (("paged", paged), ("gathered", gathered)) for k, s in group.items()}
        direct = cpu_attention.available() and args.threads == 1
        if direct:
            steps["cpu_paged_decode"] = _Step(config, "cpu_paged", decode_lengths, decode_counts, bs, layers)
            steps["cpu_paged_decode"].layer_call()
        times = _alternating(steps, args.repeats)
        step_s = {k: times[k] + steps[k].prepare_s for k in times}
        out["step_s"] = {k: round(v, 5) for k, v in step_s.items()}
        out["prepare_s"] = {k: round(s.prepare_s, 5) for k, s in steps.items()}
        out["mixed_over_parts"] = {
            "paged": round(step_s["paged_mixed"] / (step_s["paged_decode"] + step_s["paged_chunk"]), 3),
            "gathered_dense_mask": round(step_s["gathered_mixed"] /
                                         (step_s["gathered_decode"] + step_s["gathered_chunk"]), 3)}
        out["decode_paged_over_gathered"] = round(step_s["paged_decode"] / step_s["gathered_decode"], 3)
        if direct:
            out["decode_cpu_paged_over_gathered"] = round(step_s["cpu_paged_decode"] / step_s["gathered_decode"], 3)
        sb, sc = args.short_batch, args.short_context
        short = {name: _Step(config, name, [sc - 1] * sb, [1] * sb, bs, layers)
                 for name in ("paged", "gathered") + (("cpu_paged",) if direct else ())}
        for s in short.values():
            s.layer_call()
        st = _alternating(short, args.repeats)
        out["short"] = {"batch": sb, "context": sc, **{k: round(v + short[k].prepare_s, 5) for k, v in st.items()}}
    out["targets"] = {"decode_bytes_paged_le_1.1x": out["decode_bytes"]["paged_over_floor"] <= 1.1,
                      "mixed_le_1.3x_parts": out["mixed_over_parts"]["paged"] <= 1.3}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
