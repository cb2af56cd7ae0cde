"""Serve several OPT models from local checkpoints, swapping them through few device slots.

    .venv/bin/python examples/opt/serve_opt.py --models 3 --tp 2 --pp 1                # spawns 2 workers
    .venv/bin/torchrun --nproc_per_node 2 examples/opt/serve_opt.py --tp 2             # attach mode
    examples/opt/launch.sh colossalai 2 --tp 2                                       # via `colossalai run`

(or ``source .venv/bin/activate`` once, then ``python``, ``torchrun``, ``colossalai run``.)

Each model is a randomly initialised OPT of the named shape with its own seed,
written with ``save_pretrained`` to ``--ckpt-dir/<shape>-<dtype>-seed<i>`` and
loaded back from there, as a real checkpoint would be. Requests go round robin,
so with ``--max-loaded 1`` every request swaps models; the request lines say
which model each one loaded and which it evicted.

In spawn mode every worker process re-imports this script (Python's ``spawn``
start method), which is why everything runs under ``if __name__ == "__main__"``.
"""
import argparse
import asyncio
import os
import tempfile
import time

from computron import EngineConfig, LaunchEngine, ModelConfig, report, zoo


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-tiny", choices=sorted(zoo.OPT_SHAPES), help="OPT shape")
    p.add_argument("--models", type=int, default=3, help="how many models to serve")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--max-loaded", type=int, default=1, help="models resident at once")
    p.add_argument("--requests", type=int, default=9)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "computron-demo"))
    p.add_argument("--paper-mode", action="store_true", help="swap the way the paper did")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-host", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0)
    return p.parse_args()


def swap_note(records) -> str:
    """What a request's wait included: the loads and evictions the engine did for it."""
    loads = [f"loaded {r.model_id} ({r.duration * 1e3:.0f} ms)" for r in records if r.kind == "load"]
    offs = [f"evicted {r.model_id}" for r in records if r.kind == "offload"]
    return f"  <- swap: {', '.join(offs + loads)}" if loads or offs else "  (already loaded)"


async def client(engine, args):
    print(f"serving {engine.model_ids} over TP={args.tp} x PP={args.pp}, max_loaded={args.max_loaded}")
    print("weights are random (seeded), so answers are arbitrary token ids and often repeat one id "
          "(e.g. [394, 394, 394]): expected, not a bug")
    print("request 0 also pays one-time warm-up (first load of its model, first forward: thread pools, "
          "allocator), so it is slower than the swaps that follow\n")
    t_start = time.perf_counter()
    for i in range(args.requests):
        model_id = engine.model_ids[i % len(engine.model_ids)]
        prompt = [2] + [10 + (7 * i + k) % 400 for k in range(4 + i % 3)]
        seen = len(engine.metrics())
        t0 = time.perf_counter()
        out = await engine.submit(model_id, {"input_ids": prompt, "max_tokens": args.max_tokens})
        dt = (time.perf_counter() - t0) * 1e3
        note = swap_note(engine.metrics()[seen:])
        print(f"[{i:3d}] {model_id}: prompt {prompt} -> {out.tolist()}  ({dt:.1f} ms){note}")
    print(f"\n{args.requests} requests in {time.perf_counter() - t_start:.2f}s; model states {engine.model_states()}")
    print("\nswaps (every rank loads its own shard at the same time):")
    print(report.swap_table(engine.metrics()))
    print("\n" + report.summary(engine.metrics()))


def main():
    args = parse_args()  # computron logs start-up, swaps and errors at INFO by default (COMPUTRON_LOG_LEVEL)
    configs = []
    for s in range(args.models):
        path = os.path.join(args.ckpt_dir, f"{args.model}-{args.dtype}-seed{s}")
        zoo.save_random_causal_lm(args.model, path, seed=s, dtype=args.dtype)
        # no batch_manager: the engine builds a CausalLMBatchManager from the checkpoint's config
        configs.append(ModelConfig(f"opt{s}", zoo.load_causal_lm, {"path": path, "dtype": args.dtype}))
    config = EngineConfig(max_loaded=args.max_loaded, paper_mode=args.paper_mode, max_batch_size=8,
                          master_host=args.master_host, master_port=args.master_port)
    engine = LaunchEngine(config, configs, args.tp, args.pp, n_nodes=args.nnodes, node_rank=args.node_rank)
    if engine is None:  # a worker rank: it served until the master shut down
        return

    async def run():
        async with engine:
            await client(engine, args)
    asyncio.run(run())


if __name__ == "__main__":
    main()
