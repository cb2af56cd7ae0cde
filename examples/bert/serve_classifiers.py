"""Serve several fine-tunes of one BERT/RoBERTa base, swapped by the engine, each answering with its labels.

    .venv/bin/python examples/bert/serve_classifiers.py --models 4 --tp 2 --pp 1     # spawns 2 workers
    .venv/bin/python examples/bert/serve_classifiers.py --family roberta --tp 2 --pp 2
    .venv/bin/torchrun --nproc_per_node 2 examples/bert/serve_classifiers.py --pp 2  # attach mode

Each fine-tune has the same architecture (``--family``, ``--shape``) but its
own seeded random weights and its own label set (sentiment, topic, emotion,
spam, ...), written with ``save_pretrained`` to ``--ckpt-dir`` together with a
tokenizer trained on this repository's text, and loaded back from there like a
real checkpoint. Requests are text, tokenized by the batch manager with the
checkpoint's tokenizer; they go round robin over the models, so with
``--max-loaded 1`` every request swaps. One more model id, ``embed``, serves
mean-pooled sentence embeddings from the first fine-tune's backbone. With
``--check`` every answer is compared with the unsharded transformers model.
"""
import argparse
import asyncio
import os
import tempfile
import time

import torch

from computron import (EmbeddingBatchManager, EngineConfig, LaunchEngine, ModelConfig,
                       TextClassificationBatchManager, report)
from computron import zoo_understanding as zu

TASKS = ["sentiment", "topic", "emotion", "spam"]
TEXTS = ["the engine swaps models in and out of the devices", "what a wonderful pipeline",
         "tensor parallelism splits every layer", "free offer click now", "one request at a time"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="bert", choices=["bert", "roberta"])
    p.add_argument("--shape", default="tiny", choices=sorted(zu.ENCODER_SHAPES))
    p.add_argument("--models", type=int, default=3, help=f"fine-tunes to serve (label sets cycle over {TASKS})")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-loaded", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "computron-classifiers"))
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every answer with the unsharded model (float32 only)")
    return p.parse_args()


def checkpoints(args):
    out = {}
    for i in range(args.models):
        task = TASKS[i % len(TASKS)]
        name = f"{task}{i // len(TASKS) or ''}"
        path = os.path.join(args.ckpt_dir, f"{args.family}-{args.shape}-{name}")
        zu.save_random_encoder(args.family, path, "sequence", seed=100 + i, labels=zu.LABEL_SETS[task],
                               shape=args.shape)
        out[name] = path
    return out


def reference(path, bm, data):
    """The unsharded model's answer to one request alone."""
    from collections import deque

    from computron import SubmitEntry
    task, _ = bm.make_batch(deque([SubmitEntry(0, data)]))
    batch = {k: v for k, v in task.batch.items() if k != "pooling"}
    model = zu.load_encoder(path)
    with torch.inference_mode():
        if isinstance(bm, EmbeddingBatchManager):
            from computron.models.encoder import pool
            return pool(model.base_model(**batch).last_hidden_state, batch["attention_mask"], bm.pooling)[0]
        return model(**batch).logits[0]


async def client(engine, args, paths, bms):
    print(f"serving {engine.model_ids} ({args.family}-{args.shape}) over TP={args.tp} x PP={args.pp}, "
          f"max_loaded={args.max_loaded}; weights are random, so labels and scores are arbitrary\n")
    ids = engine.model_ids
    worst = 0.0
    for k in range(args.requests):
        mid = ids[k % len(ids)]
        data = {"text": TEXTS[k % len(TEXTS)]}
        if mid != "embed":
            data["top_k"] = 2
        t0 = time.perf_counter()
        out = await engine.submit(mid, data)
        dt = (time.perf_counter() - t0) * 1e3
        if mid == "embed":
            got, shown = out["embedding"], f"embedding[{len(out['embedding'])}] ({out['pooling']} pooling)"
        else:
            got = out["logits"]
            shown = ", ".join(f"{x['label']} {x['score']:.3f}" for x in out["labels"])
        line = f"[{k:3d}] {mid:10s} {data['text']!r:55s} -> {shown}  ({dt:.1f} ms)"
        if args.check:
            err = (torch.tensor(got) - reference(paths[mid], bms[mid], data).float()).abs().max().item()
            worst = max(worst, err)
            line += f"  |sharded - unsharded| {err:.1e}"
        print(line)
    if args.check:
        print(f"\nlargest difference from the unsharded models: {worst:.2e}")
    print("\n" + report.swap_table(engine.metrics()))
    print("\n" + report.summary(engine.metrics()))


def main():
    args = parse_args()
    if args.dtype != "float32":
        args.check = False
    paths = checkpoints(args)
    bms = {name: TextClassificationBatchManager.for_checkpoint(p) for name, p in paths.items()}
    first = next(iter(paths))
    paths["embed"] = paths[first]
    bms["embed"] = EmbeddingBatchManager.for_checkpoint(paths[first], pooling="mean")
    configs = [ModelConfig(name, zu.load_encoder, {"path": paths[name], "dtype": args.dtype}, batch_manager=bm)
               for name, bm in bms.items()]
    engine = LaunchEngine(EngineConfig(max_loaded=args.max_loaded), configs, args.tp, args.pp)
    if engine is None:  # a worker rank under torchrun: it served until the master shut down
        return

    async def run():
        async with engine:
            await client(engine, args, paths, bms)
    asyncio.run(run())


if __name__ == "__main__":
    main()
