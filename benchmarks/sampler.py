"""The sampler's cost per decode step, in process: host bytes and time, the batched device path against the host path.

``B`` rows of random logits [B, V] (default 8 × 49152, SmolLM2's vocabulary) with a mix of controls (greedy,
temperature, top-k, top-p, min-p, penalties, logit bias, logprobs) go through ``models.sampling.pick`` for
``--steps`` steps, two ways, alternating A B A B:

- ``host``: the way steps sampled before the device sampler: the logits copied to the host, then each row
  sampled on its own (one ``pick`` of a [1, V] row per sequence, generators on the CPU);
- ``device``: one batched ``pick`` of the whole [B, V] on the logits' device (``--device``).

Host bytes are counted where Python code brings tensor values to the host (``.cpu()``, ``.tolist()``,
``.item()``, ``.numpy()``); on a CPU both run on the same memory, so the bytes are what a GPU would copy.
Prints ONE JSON line: per path ``ms_per_step`` (median of the counted rounds) and ``host_bytes_per_step``, and
``device_over_host`` of each; on CUDA also the device path's ``syncs_per_step`` (operations that waited for the
device, ``torch.cuda.set_sync_debug_mode``: the one copy of the ids is expected).

    .venv/bin/python benchmarks/sampler.py                      # B=8, V=49152, CPU, seconds
    .venv/bin/python benchmarks/sampler.py --device cuda --batch 64
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

CONTROLS = [{}, {"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7, "top_k": 50},
            {"temperature": 1.0, "min_p": 0.05}, {"repetition_penalty": 1.2, "temperature": 0.9, "top_p": 0.95},
            {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": ((5, 2.0), (9, -5.0))},
            {"temperature": 1.0, "logprobs": 5}]


class HostCopies:
    """Counts the bytes Python code brings to the host while active."""

    NAMES = ("cpu", "tolist", "item", "numpy")

    def __init__(self):
        self.bytes, self._saved = 0, {}

    def __enter__(self):
        for name in self.NAMES:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **kw):
                self.bytes += t.numel() * t.element_size()
                return _original(t, *a, **kw)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def specs_and_state(batch: int, device: torch.device):
    from computron.comm.messages import SeqSpec
    from computron.models.sampling import SeqSampler, seq_generator
    specs = [SeqSpec(sid=i, prompt=tuple(range(3, 40 + i)), max_tokens=10 ** 6, eos=(2,), seed=i,
                     **CONTROLS[i % len(CONTROLS)]) for i in range(batch)]
    gens = {s.sid: seq_generator(s, device) for s in specs}
    return specs, {s.sid: SeqSampler(s, gens[s.sid]) for s in specs}, gens


def run(way: str, steps: int, logits, device: torch.device):
    from computron.models.sampling import pick
    host = torch.device("cpu")
    specs, samplers, gens = specs_and_state(logits[0].shape[0], host if way == "host" else device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    watch_syncs = way == "device" and device.type == "cuda"
    with HostCopies() as copies, warnings.catch_warnings(record=True) as syncs:
        if watch_syncs:  # CUDA: every operation that waits for the device warns once per call
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        for x in logits[:steps]:
            if way == "host":
                y = x.cpu()
                for i, s in enumerate(specs):
                    pick(y[i:i + 1], [s], samplers, gens)
            else:
                pick(x, specs, samplers, gens)
        if watch_syncs:
            torch.cuda.set_sync_debug_mode("default")
        sync()
        elapsed = time.perf_counter() - t0
    out = {"ms_per_step": round(1e3 * elapsed / steps, 3), "host_bytes_per_step": copies.bytes // steps}
    if watch_syncs:
        out["syncs_per_step"] = len(syncs) / steps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="A B rounds; the first warms up and is not counted")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a worker's default: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = [(torch.randn(args.batch, args.vocab, generator=gen) * 4).to(dev) for _ in range(args.steps)]
    results = {"host": [], "device": []}
    for r in range(args.rounds):
        for way in ("host", "device"):
            got = run(way, args.steps, logits, dev)
            if r:
                results[way].append(got)
    out = {"bench": "sampler", "batch": args.batch, "vocab": args.vocab, "steps": args.steps, "on": args.device,
           "threads": args.threads}
    for way, got in results.items():
        out[way] = {**got[-1], "ms_per_step": round(sorted(g["ms_per_step"] for g in got)[len(got) // 2], 3)}
    out["device_over_host"] = {k: round(out["device"][k] / out["host"][k], 4)
                               for k in ("ms_per_step", "host_bytes_per_step")}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
