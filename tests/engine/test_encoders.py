"""Encoders, classifiers and ViT: sharded answers equal the unsharded model's; fine-tunes swap with their labels."""
import asyncio
import base64
import functools
import io
import json
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from computron import (EmbeddingBatchManager, EngineConfig, ImageClassificationBatchManager, LaunchEngine,
                       ModelConfig, PayloadError, SubmitEntry, TaskEntry, TextClassificationBatchManager,
                       WorkerError)
from computron import zoo_understanding as zu
from computron.models import FAMILIES, encoder_family, family_of, make_runner
from computron.models.encoder import pool

TEXTS = ["serve many models on shared gpus", "swap", "tensor parallelism splits every layer over the workers",
         "a master scheduler keeps few models resident", "pipeline"]
IDS = [[2, 40, 41, 42, 3], [2, 7, 3], [2] + list(range(60, 90)) + [3]]
FINE_TUNES = {"sentiment": 11, "topic": 12, "emotion": 13}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("enc")
    paths = {
        "cls": zu.save_random_encoder("bert", str(root / "cls"), "sequence", seed=1, labels=zu.LABEL_SETS["topic"]),
        "ner": zu.save_random_encoder("roberta", str(root / "ner"), "token", seed=2),
        "vit": zu.save_random_encoder("vit", str(root / "vit"), "image", seed=3),
        "emb": zu.save_random_encoder("bert", str(root / "emb"), "base", seed=4),
    }
    for name, seed in FINE_TUNES.items():
        paths[name] = zu.save_random_encoder("bert", str(root / name), "sequence", seed=seed,
                                             labels=zu.LABEL_SETS[name])
    return paths


def poisoned_encoder(path: str, length: int):
    """An encoder whose first layer raises on inputs of ``length`` tokens: a stage-0 failure at PP=2."""
    model = zu.load_encoder(path)

    def hook(_module, args):
        if args[0].shape[1] == length:
            raise ValueError(f"poisoned length {length}")
    model.base_model.encoder.layer[0].register_forward_pre_hook(hook)
    return model


def png_bytes(seed: int, size=(40, 28)) -> bytes:
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def alone(bm, data):
    """The batch one request makes on its own: what the unsharded reference runs."""
    task, _ = bm.make_batch(deque([SubmitEntry(0, data)]))
    return {k: v for k, v in task.batch.items() if k != "pooling"}


@functools.lru_cache(maxsize=None)
def unsharded(path):
    return zu.load_encoder(path)


@torch.inference_mode()
def reference(path, bm, data):
    """The unsharded model's answer to ``data`` sent alone (embeddings: pooled from its backbone)."""
    batch = alone(bm, data)
    if isinstance(bm, EmbeddingBatchManager):
        out = unsharded(path).base_model(**batch)
        return pool(out.last_hidden_state, batch["attention_mask"], bm.pooling)[0]
    return unsharded(path)(**batch).logits[0]


def close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want.float(), rtol=1e-5, atol=2e-6)


# ---- sharded == unsharded ----------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_encoders_match_unsharded(encoders, tp, pp):
    bms = {"cls": TextClassificationBatchManager.for_checkpoint(encoders["cls"]),
           "ner": TextClassificationBatchManager.for_checkpoint(encoders["ner"]),
           "vit": ImageClassificationBatchManager.for_checkpoint(encoders["vit"]),
           "emb": EmbeddingBatchManager.for_checkpoint(encoders["emb"]),
           # a classifier checkpoint serving CLS embeddings: the head is skipped
           "cls-emb": EmbeddingBatchManager.for_checkpoint(encoders["cls"], pooling="cls")}
    paths = {m: encoders["cls" if m == "cls-emb" else m] for m in bms}
    g = torch.Generator().manual_seed(0)
    requests = {
        "cls": [{"text": t, "top_k": 2} for t in TEXTS] + [{"input_ids": i} for i in IDS],
        "ner": [{"text": t} for t in TEXTS[:4]],
        "vit": [{"pixel_values": torch.randn(3, 32, 32, generator=g)},
                {"pixel_values": torch.randn(1, 3, 32, 32, generator=g).tolist(), "top_k": 3},
                {"image": png_bytes(0)}, {"image": base64.b64encode(png_bytes(1)).decode()}],
        "emb": [{"text": t} for t in TEXTS[:3]] + [{"input_ids": IDS[0], "normalize": True}],
        "cls-emb": [{"text": t} for t in TEXTS[1:4]],
    }
    configs = [ModelConfig(m, zu.load_encoder, {"path": paths[m]}, batch_manager=bm) for m, bm in bms.items()]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=len(configs)), configs, tp, pp)
        async with engine:
            jobs = [(m, d) for m, reqs in requests.items() for d in reqs]
            outs = await asyncio.gather(*[engine.submit(m, d) for m, d in jobs])
            return list(zip(jobs, outs)), engine.metrics("batch"), {r: w.host_bytes for r, w in engine.workers.items()}
    results, batches, host_bytes = asyncio.run(go())
    for m in bms:  # each rank keeps only its shard: layers split, embeddings and head on their stage only
        full = unsharded(paths[m])
        nbytes = sum(t.numel() * t.element_size() for t in list(full.parameters()) + list(full.buffers()))
        assert max(h[m] for h in host_bytes.values()) < 0.8 * nbytes, m
    for (m, data), out in results:
        json.dumps(out)  # answers are JSON-able as they come
        want = reference(paths[m], bms[m], data)
        if m in ("emb", "cls-emb"):
            if data.get("normalize"):
                want = torch.nn.functional.normalize(want, dim=-1)
            close(out["embedding"], want)
            assert out["pooling"] == bms[m].pooling
        elif m == "ner":
            assert len(out["labels"]) == len(out["logits"]) == len(out["tokens"]) == want.shape[0]
            close(out["logits"], want)
            assert out["labels"] == [bms[m].labels[i] for i in want.argmax(-1).tolist()]
        else:
            close(out["logits"], want)
            labels = zu.LABEL_SETS["topic" if m == "cls" else "objects"]
            k = data.get("top_k", 1 if m == "cls" else 5)
            assert [x["label"] for x in out["labels"]] == [labels[i] for i in want.topk(k).indices.tolist()]
            assert out["label"] == out["labels"][0]["label"]
            assert abs(sum(torch.softmax(want, -1).tolist()) - 1) < 1e-5
    # mixed lengths were batched together (right padding exercised), every request ran once
    by_model = {}
    for b in batches:
        by_model.setdefault(b.model_id, []).append(b.batch_size)
    assert max(by_model["cls"]) > 1 and max(by_model["vit"]) > 1
    assert sum(b.batch_size for b in batches) == sum(len(r) for r in requests.values())
    assert all(set(b.rank_times) == set(range(tp * pp)) for b in batches)


# ---- fine-tunes of one base, swapped -------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_fine_tunes_swap_and_answer_with_their_own_labels(encoders):
    names = list(FINE_TUNES)
    bms = {n: TextClassificationBatchManager.for_checkpoint(encoders[n]) for n in names}
    configs = [ModelConfig(n, zu.load_encoder, {"path": encoders[n]}, batch_manager=bms[n]) for n in names]
    configs.append(ModelConfig("poisoned", poisoned_encoder, {"path": encoders["sentiment"], "length": 3},
                               batch_manager=bms["sentiment"]))
    order = [names[k % 3] for k in range(7)]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1), configs, 1, 2)
        async with engine:
            outs = []
            for k, n in enumerate(order):
                outs.append(await engine.submit(n, {"text": TEXTS[k % len(TEXTS)], "top_k": 10}))
                assert engine.model_states()[n] == "loaded"
                assert sum(s == "loaded" for s in engine.model_states().values()) == 1
            with pytest.raises(PayloadError, match="exactly one of"):
                await engine.submit(names[0], {"text": "x", "input_ids": [1]})
            # stage 0 fails: stage 1 is told instead of waiting, and the engine keeps serving
            with pytest.raises(WorkerError, match="poisoned length 3"):
                await engine.submit("poisoned", {"input_ids": [2, 9, 3]})
            ok = await engine.submit("poisoned", {"input_ids": [2, 9, 9, 3]})
            assert ok["label"] in zu.LABEL_SETS["sentiment"]
            return outs, engine.metrics("load")
    outs, loads = asyncio.run(go())
    assert [r.model_id for r in loads][:len(order)] == order  # every request made its model swap in
    for k, (n, out) in enumerate(zip(order, outs)):
        own = zu.LABEL_SETS[n]
        assert sorted(x["label"] for x in out["labels"]) == sorted(own)  # all of its labels, no other's
        close(out["logits"], reference(encoders[n], bms[n], {"text": TEXTS[k % len(TEXTS)]}))


# ---- batch managers, no processes ----------------------------------------------------------------------
def test_text_batches_right_pad_and_split(encoders):
    bm = TextClassificationBatchManager.for_checkpoint(encoders["cls"], max_batch_size=2)
    q = deque([SubmitEntry(0, {"input_ids": [2, 5, 6, 3], "token_type_ids": [0, 0, 1, 1]}),
               SubmitEntry(1, {"input_ids": [2, 9, 3], "top_k": 3}), SubmitEntry(2, {"text": "later"})])
    task, info = bm.make_batch(q)
    assert task.uids == (0, 1) and [e.uid for e in q] == [2]
    assert task.batch["input_ids"].tolist() == [[2, 5, 6, 3], [2, 9, 3, 0]]
    assert task.batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert task.batch["token_type_ids"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 4.0]])
    got = dict(bm.split_batch(TaskEntry(task.uids, {"logits": logits}), **info))
    assert got[0]["label"] == "sports" and len(got[0]["labels"]) == 1
    assert [x["label"] for x in got[1]["labels"]] == ["world", "science", "sports"]
    assert got[1]["score"] == pytest.approx(torch.softmax(logits[1], -1)[0].item())
    # text is tokenized with the checkpoint's tokenizer, truncated to the model's positions
    task, _ = bm.make_batch(deque([SubmitEntry(3, {"text": "word " * 500})]))
    assert task.batch["input_ids"].shape == (1, 64)


def test_image_bytes_are_decoded_with_the_checkpoint_processor(encoders):
    from PIL import Image
    bm = ImageClassificationBatchManager.for_checkpoint(encoders["vit"])
    raw = png_bytes(5)
    task, info = bm.make_batch(deque([SubmitEntry(0, {"image": raw}),
                                      SubmitEntry(1, {"image": "data:image/png;base64," +
                                                      base64.b64encode(raw).decode()})]))
    want = bm.processor(images=[Image.open(io.BytesIO(raw)).convert("RGB")], return_tensors="pt")["pixel_values"]
    assert task.batch["pixel_values"].shape == (2, 3, 32, 32)
    torch.testing.assert_close(task.batch["pixel_values"], want.expand(2, -1, -1, -1))
    assert info["top_k"] == [5, 5]
    # an image whose header reads but whose data does not decode fails at submit (the engine prepares
    # every request); handed to make_batch unprepared, it fails alone, not with its batch
    broken = raw[:len(raw) // 2]
    with pytest.raises(PayloadError, match="input|image"):
        bm.prepare({"image": broken})
    q = deque([SubmitEntry(0, {"image": raw}), SubmitEntry(1, {"image": broken}), SubmitEntry(2, {"image": raw})])
    task, _ = bm.make_batch(q)
    assert task.uids == (0,) and [e.uid for e in q] == [1, 2]
    with pytest.raises(PayloadError):
        bm.make_batch(q)
    assert [e.uid for e in q] == [2]


@pytest.mark.parametrize("kind,data,needle", [
    ("text", "hello", "dict"),
    ("text", {}, "exactly one of 'input_ids' and 'text'"),
    ("text", {"input_ids": []}, "empty"),
    ("text", {"input_ids": [1, 2.5]}, "list of ints"),
    ("text", {"input_ids": [1, 99999]}, "input_ids must lie in"),
    ("text", {"input_ids": list(range(1, 80))}, "at most 64"),
    ("text", {"input_ids": [1, 2], "attention_mask": [1]}, "attention_mask"),
    ("text", {"input_ids": [1, 2], "token_type_ids": [0, 5]}, "token_type_ids"),
    ("text", {"text": ""}, "text must be a non-empty string"),
    ("text", {"text": "a", "top_k": 0}, "top_k"),
    ("text", {"text": "a", "bogus": 1}, "bogus"),
    ("notok", {"text": "a"}, "no tokenizer"),
    ("emb", {"text": "a", "normalize": "yes"}, "normalize"),
    ("image", {"pixel_values": torch.zeros(3, 16, 16)}, "shape (3, 16, 16)"),
    ("image", {"pixel_values": [[1, "a"]]}, "pixel_values"),
    ("image", {"image": b"not an image"}, "no image PIL can read"),
    ("image", {"image": "%%%"}, "base64"),
    ("image", {"image": b"x", "pixel_values": [1]}, "exactly one of"),
    ("image", {"image": png_bytes(0), "top_k": -1}, "top_k"),
])
def test_batch_managers_reject_malformed_requests(encoders, kind, data, needle):
    bm = {"text": lambda: TextClassificationBatchManager.for_checkpoint(encoders["cls"]),
          "notok": lambda: TextClassificationBatchManager(num_labels=2, vocab_size=100),
          "emb": lambda: EmbeddingBatchManager.for_checkpoint(encoders["emb"]),
          "image": lambda: ImageClassificationBatchManager.for_checkpoint(encoders["vit"])}[kind]()
    with pytest.raises((ValueError, TypeError)) as err:
        bm.validate(data)
    assert needle in str(err.value)


def test_for_checkpoint_checks_the_head(encoders):
    with pytest.raises(ValueError, match="no sequence or token classification head"):
        TextClassificationBatchManager.for_checkpoint(encoders["emb"])
    with pytest.raises(ValueError, match="no image classification head"):
        ImageClassificationBatchManager.for_checkpoint(encoders["cls"])
    assert TextClassificationBatchManager.for_checkpoint(encoders["ner"]).task == "token"
    with pytest.raises(ValueError, match="pooling"):
        EmbeddingBatchManager(pooling="max")


# ---- family table and plans ----------------------------------------------------------------------------------
def test_family_table_maps_architectures_to_families():
    assert family_of(zu.random_encoder("bert", "token")).name == "bert"
    assert encoder_family(zu.random_encoder("roberta", "sequence")).name == "roberta"
    assert encoder_family(zu.random_encoder("vit", "base")).name == "vit"
    from computron import zoo
    assert family_of(zoo.random_causal_lm("opt-tiny")).runner == "causal_lm"
    assert encoder_family(zoo.random_causal_lm("opt-tiny")) is None  # causal LMs keep their own runner
    assert encoder_family(zoo.mlp()) is None
    # every encoder plan names Linear layers that exist in its family's layer
    for fam in FAMILIES:
        if fam.runner != "encoder":
            continue
        model = zu.random_encoder(fam.name, "base")
        layer = model.get_submodule(fam.layers)[0]
        for path in fam.tp_plan():
            assert isinstance(layer.get_submodule(path), torch.nn.Linear), (fam.name, path)


def test_tp_size_must_divide_heads():
    layout = SimpleNamespace(tp=3, pp=1, output_rank=0)
    ctx = SimpleNamespace(groups=SimpleNamespace(layout=layout, stage=0, rank=0), tp=3, pp=1, stage=0,
                          is_first=True, is_last=True, model_id="clf")
    with pytest.raises(ValueError, match=r"model 'clf': config.num_attention_heads=4 is not divisible by "
                                         r"tp_world_size=3"):
        make_runner(zu.random_encoder("bert", "sequence"), ModelConfig("clf", zu.load_encoder), ctx)
