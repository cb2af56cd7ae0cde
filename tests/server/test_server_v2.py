"""`computron serve` for encoders, classifiers and ViT: the Open Inference Protocol (KServe v2 REST) and
OpenAI's /v1/embeddings, against a live server whose answers are checked against the unsharded model.

One server (two BERT classifiers with different label sets, one BERT embedding model, one ViT classifier,
max_loaded=1 so they swap) is shared by the live tests; the 429/503 statuses use a stub engine in-thread.
"""
import base64
import functools
import io
from collections import deque

import httpx
import openai
import pytest
import torch
from serve_helpers import ServerProcess, StubEngineBase, app_in_thread

from computron import zoo_understanding as zu
from computron.batching.base import SubmitEntry
from computron.errors import QueueFullError
from computron.models.encoder import pool
from computron.server import create_app
from computron.server.config import ConfigError, ServerSettings
from computron.batching.images import ImageClassificationBatchManager
from computron.batching.text import EmbeddingBatchManager, TextClassificationBatchManager

pytestmark = pytest.mark.timeout(300)

TEXTS = ["serve many models on shared gpus", "swap", "a master scheduler keeps few models resident"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2-ckpt")
    return {
        "sentiment": zu.save_random_encoder("bert", str(root / "sentiment"), "sequence", seed=11,
                                            labels=zu.LABEL_SETS["sentiment"]),
        "topic": zu.save_random_encoder("bert", str(root / "topic"), "sequence", seed=12,
                                        labels=zu.LABEL_SETS["topic"]),
        "emb": zu.save_random_encoder("bert", str(root / "emb"), "base", seed=4),
        "vit": zu.save_random_encoder("vit", str(root / "vit"), "image", seed=3),
    }


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    srv = ServerProcess(str(tmp_path_factory.mktemp("serve-v2")), ckpts, engine={"max_loaded": 1})
    yield srv
    rc, left = srv.stop()
    assert not left and rc == 0, srv.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# ---- the unsharded reference ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def unsharded(path):
    return zu.load_encoder(path)


@functools.lru_cache(maxsize=None)
def manager(path, kind):
    return {"text": TextClassificationBatchManager, "emb": EmbeddingBatchManager,
            "image": ImageClassificationBatchManager}[kind].for_checkpoint(path)


@torch.inference_mode()
def reference(path, kind, data):
    """Logits (classifiers) or the mean-pooled embedding of ``data`` sent alone to the unsharded model."""
    bm = manager(path, kind)
    task, _ = bm.make_batch(deque([SubmitEntry(0, data)]))
    batch = {k: v for k, v in task.batch.items() if k != "pooling"}
    if kind == "emb":
        out = unsharded(path).base_model(**batch)
        return pool(out.last_hidden_state, batch["attention_mask"], "mean")[0]
    return unsharded(path)(**batch).logits[0]


def close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32).reshape(want.shape), want.float(),
                               rtol=1e-5, atol=2e-6)


def png_b64(seed, size=(40, 28)):
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def truncated_png_b64(seed):
    raw = base64.b64decode(png_b64(seed))
    return base64.b64encode(raw[:len(raw) // 2]).decode()


def tensor(name, datatype, shape, data):
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def outputs(r):
    assert r.status_code == 200, r.text
    return {o["name"]: o for o in r.json()["outputs"]}


# ---- metadata and readiness ---------------------------------------------------------------------------

def test_metadata_ready_and_model_list(http):
    meta = http.get("/v2/models/sentiment").json()
    assert meta["name"] == "sentiment" and meta["platform"] == "computron" and meta["versions"] == ["1"]
    ins = {i["name"]: i for i in meta["inputs"]}
    assert ins["text"] == {"name": "text", "datatype": "BYTES", "shape": [-1]}
    assert ins["input_ids"] == {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}
    outs = {o["name"]: o for o in meta["outputs"]}
    assert outs["label"]["datatype"] == "BYTES" and outs["logits"] == {"name": "logits", "datatype": "FP32",
                                                                       "shape": [-1, 2]}
    assert {o["name"]: o["shape"] for o in http.get("/v2/models/topic").json()["outputs"]}["logits"] == [-1, 4]
    vit = {i["name"]: i for i in http.get("/v2/models/vit").json()["inputs"]}
    assert vit["pixel_values"] == {"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, 32, 32]}
    assert vit["image"]["datatype"] == "BYTES"
    emb = http.get("/v2/models/emb").json()["outputs"]
    assert emb == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 32]}]
    assert http.get("/v2/models/emb/versions/1").json()["name"] == "emb"
    for m in ("sentiment", "topic", "emb", "vit"):
        r = http.get(f"/v2/models/{m}/ready")
        assert r.status_code == 200 and r.json()["ready"] is True
    assert http.get("/v2/health/ready").status_code == 200 and http.get("/v2/health/live").status_code == 200
    r = http.get("/v2/models/nope/ready")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    assert http.get("/v2/models/nope").status_code == 404
    listed = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert listed == {"sentiment", "topic", "emb", "vit"}


# ---- infer against the unsharded model ----------------------------------------------------------------

def test_classifiers_swap_and_answer_with_their_own_labels(http, ckpts):
    for rnd in range(2):  # max_loaded=1: each request swaps the other classifier out
        for m in ("sentiment", "topic"):
            body = {"id": f"r{rnd}{m}", "inputs": [tensor("text", "BYTES", [3], TEXTS)],
                    "parameters": {"top_k": 2}}
            r = http.post(f"/v2/models/{m}/infer", json=body)
            out = outputs(r)
            assert r.json()["model_name"] == m and r.json()["id"] == f"r{rnd}{m}"
            assert out["label"]["shape"] == [3, 2] and out["score"]["datatype"] == "FP32"
            labels = zu.LABEL_SETS[m]
            assert out["logits"]["shape"] == [3, len(labels)]
            for i, t in enumerate(TEXTS):
                want = reference(ckpts[m], "text", {"text": t})
                close(out["logits"]["data"][i * len(labels):(i + 1) * len(labels)], want)
                top = want.softmax(-1).topk(2)
                assert out["label"]["data"][2 * i:2 * i + 2] == [labels[j] for j in top.indices.tolist()]
                close(out["score"]["data"][2 * i:2 * i + 2], top.values)
    batches = [e for e in http.get("/api/events").json()["events"] if e["kind"] == "batch"]
    sizes = {m: max(e["batch_size"] for e in batches if e["model_id"] == m) for m in ("sentiment", "topic")}
    assert sizes["sentiment"] > 1 and sizes["topic"] > 1, sizes  # one infer's rows ran as one batch
    loads = [e for e in http.get("/api/events").json()["events"] if e["kind"] == "load"]
    assert len(loads) >= 4  # they swapped


def test_input_ids_with_padding_mask_and_requested_outputs(http, ckpts):
    rows = [[2, 40, 41, 42, 3], [2, 7, 3]]
    ids = [r + [0] * (5 - len(r)) for r in rows]
    mask = [[1] * len(r) + [0] * (5 - len(r)) for r in rows]
    body = {"inputs": [tensor("input_ids", "INT64", [2, 5], ids), tensor("attention_mask", "INT32", [2, 5], mask)],
            "outputs": [{"name": "label"}]}
    r = http.post("/v2/models/topic/infer", json=body)
    out = outputs(r)
    assert list(out) == ["label"] and out["label"]["shape"] == [2, 1] and "id" not in r.json()
    want = [zu.LABEL_SETS["topic"][int(reference(ckpts["topic"], "text", {"input_ids": x}).argmax())] for x in rows]
    assert out["label"]["data"] == want


def test_vit_png_and_pixel_values(http, ckpts):
    imgs = [png_b64(0), png_b64(1)]
    out = outputs(http.post("/v2/models/vit/infer", json={"inputs": [tensor("image", "BYTES", [2], imgs)],
                                                          "parameters": {"top_k": 3}}))
    labels = zu.LABEL_SETS["objects"]
    assert out["label"]["shape"] == [2, 3] and out["logits"]["shape"] == [2, 8]
    for i, img in enumerate(imgs):
        want = reference(ckpts["vit"], "image", {"image": img})
        close(out["logits"]["data"][8 * i:8 * (i + 1)], want)
        assert out["label"]["data"][3 * i:3 * i + 3] == [labels[j] for j in want.topk(3).indices.tolist()]
    px = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    out = outputs(http.post("/v2/models/vit/infer", json={"inputs": [
        tensor("pixel_values", "FP32", [1, 3, 32, 32], px.flatten().tolist())]}))
    want = reference(ckpts["vit"], "image", {"pixel_values": px[0]})
    close(out["logits"]["data"], want)
    assert out["label"]["shape"] == [1, 5] and out["label"]["data"][0] == labels[int(want.argmax())]


def test_embeddings_v2_and_openai_client(server, http, ckpts):
    wants = [reference(ckpts["emb"], "emb", {"text": t}) for t in TEXTS]
    out = outputs(http.post("/v2/models/emb/infer", json={"inputs": [tensor("text", "BYTES", [3, 1], TEXTS)]}))
    assert out["embedding"]["shape"] == [3, 32]
    for i, w in enumerate(wants):
        close(out["embedding"]["data"][32 * i:32 * (i + 1)], w)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
    assert r.object == "list" and r.model == "emb" and [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, wants):
        close(d.embedding, w)
    tok = manager(ckpts["emb"], "emb").tokenizer
    n = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    r = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    close(r.data[0].embedding, wants[0])
    ids = [2, 40, 41, 42, 3]
    body = http.post("/v1/embeddings", json={"model": "emb", "input": [ids, ids[:3]]}).json()
    close(body["data"][1]["embedding"], reference(ckpts["emb"], "emb", {"input_ids": ids[:3]}))
    assert body["usage"]["prompt_tokens"] == 8


# ---- bad requests --------------------------------------------------------------------------------------

def test_bad_tensors_answer_400_naming_the_input(http):
    good = tensor("text", "BYTES", [1], ["hi"])
    cases = [
        ("sentiment", [tensor("text", "BYTES", [2], ["a"])], "'text'"),  # data length vs shape
        ("sentiment", [tensor("text", "STRING", [1], ["a"])], "'text'"),  # not a v2 datatype
        ("sentiment", [tensor("text", "FP32", [1], [1.0])], "'text'"),  # a v2 datatype the input does not take
        ("sentiment", [tensor("text", "BYTES", [1, 2], ["a", "b"])], "'text'"),  # wrong shape
        ("sentiment", [tensor("input_ids", "INT64", [2, 2], [1, 2, 3, 4]),
                       tensor("attention_mask", "INT64", [2, 3], [1] * 6)], "'attention_mask'"),
        ("sentiment", [tensor("input_ids", "INT64", [1, 2], [1, 99999])], "'input_ids'"),  # out of vocabulary
        ("sentiment", [tensor("colour", "BYTES", [1], ["red"])], "'colour'"),  # unknown input
        ("sentiment", [tensor("attention_mask", "INT64", [1, 1], [1])], "'text'"),  # the required input missing
        ("sentiment", [{"name": "text", "datatype": "BYTES", "data": ["a"]}], "'text'"),  # no shape
        ("vit", [tensor("pixel_values", "FP32", [1, 3, 16, 16], [0.0] * 768)], "'pixel_values'"),
        ("vit", [tensor("image", "BYTES", [1], ["bm90IGFuIGltYWdl"])], "'image'"),  # base64, but no image
        ("vit", [tensor("image", "BYTES", [2], [png_b64(1), truncated_png_b64(2)])],
         "input 'image': row 1: the bytes are no image PIL can read"),  # a PNG cut short: refused at submit
        ("vit", [good], "'text'"),
    ]
    for model, inputs, needle in cases:
        r = http.post(f"/v2/models/{model}/infer", json={"inputs": inputs})
        assert r.status_code == 400, (model, inputs, r.text)
        assert set(r.json()) == {"error"} and needle in r.json()["error"], (inputs, r.json())
    r = http.post("/v2/models/sentiment/infer", json={"inputs": [good], "parameters": {"normalize": True}})
    assert r.status_code == 400 and "normalize" in r.json()["error"]
    r = http.post("/v2/models/sentiment/infer", json={"inputs": [good], "outputs": [{"name": "embedding"}]})
    assert r.status_code == 400 and "embedding" in r.json()["error"]
    r = http.post("/v2/models/nope/infer", json={"inputs": [good]})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = http.post("/v2/models/sentiment/infer", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    # the server still answers after all of these
    assert outputs(http.post("/v2/models/sentiment/infer", json={"inputs": [good]}))["label"]["shape"] == [1, 1]


def test_openai_routes_refuse_the_wrong_kind_of_model(server, http):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="sentiment", input="hello")
    assert "'sentiment'" in str(e.value) and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hello")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="emb", prompt="hello", max_tokens=2)
    assert "'emb'" in str(e.value) and "/v2/models/emb/infer" in str(e.value)
    for body, param in (({"model": "emb", "input": ""}, "input"), ({"model": "emb", "input": [1.5]}, "input"),
                        ({"model": "emb", "input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"model": "emb", "input": "a", "dimensions": 7}, "dimensions")):
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/v1/embeddings", json={"model": "emb", "input": "a", "colour": 1})
    assert r.status_code == 200, r.text  # an unknown field is ignored (logged once), as other servers do


# ---- statuses that need the engine in a given state: a stub engine behind an in-thread server ----------

class StubEngine(StubEngineBase):
    def __init__(self, dim):
        super().__init__("e")
        self.dim = dim

    async def submit(self, model_id, data, timeout=None):
        if self.error:
            raise self.error
        return {"embedding": [0.5] * self.dim, "pooling": "mean"}


def test_queue_full_429_and_engine_dead_503(ckpts):
    from computron.server.v2 import EMBEDDING, UnderstandingModel
    enc = UnderstandingModel("e", ckpts["emb"], EMBEDDING, manager(ckpts["emb"], "emb"), hidden_size=32)
    engine = StubEngine(32)
    app = create_app(engine, {}, ServerSettings(), encoders={"e": enc})
    body = {"inputs": [tensor("text", "BYTES", [2], ["a b", "c"])]}
    with app_in_thread(app) as url:
        assert outputs(httpx.post(url + "/v2/models/e/infer", json=body))["embedding"]["shape"] == [2, 32]
        engine.error = QueueFullError("model 'e' already has 4 waiting requests (queue_size=4)")
        r = httpx.post(url + "/v2/models/e/infer", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and "queue_size" in r.json()["error"]
        r = httpx.post(url + "/v1/embeddings", json={"model": "e", "input": "a"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        engine.error, engine.dead = None, "engine is dead: worker rank 0 exited unexpectedly"
        assert httpx.get(url + "/v2/models/e/ready").status_code == 503
        assert httpx.get(url + "/v2/health/ready").status_code == 503
        r = httpx.post(url + "/v2/models/e/infer", json=body)
        assert r.status_code == 503 and "dead" in r.json()["error"]
        assert httpx.post(url + "/v1/embeddings", json={"model": "e", "input": "a"}).status_code == 503


# ---- configuration (no workers) --------------------------------------------------------------------------

def test_config_picks_batch_managers_and_checks_task(ckpts, tmp_path, capsys):
    from computron.server.building import build_models
    from computron.server.cli import _parser, build_config, main
    cfg = build_config(_parser().parse_args(["serve", *[f"{m}={p}" for m, p in ckpts.items()],
                                             f"cls-emb={ckpts['topic']}", "--task", "cls-emb=embedding"]))
    assert [m.kind for m in cfg.models] == ["sequence-classification", "sequence-classification", "embedding",
                                            "image-classification", "embedding"]
    built = build_models(cfg)
    assert not [b for b in built if b.served.text is not None]
    encoders = {b.served.id: b.served.understanding for b in built}
    assert set(encoders) == {"sentiment", "topic", "emb", "vit", "cls-emb"}
    kinds = {m: type(e.batch_manager) for m, e in encoders.items()}
    assert kinds == {"sentiment": TextClassificationBatchManager, "topic": TextClassificationBatchManager,
                     "emb": EmbeddingBatchManager, "cls-emb": EmbeddingBatchManager,
                     "vit": ImageClassificationBatchManager}
    assert encoders["topic"].labels == zu.LABEL_SETS["topic"]
    mcs = [b.config for b in built]
    assert all(mc.model_fn is zu.load_encoder and mc.batch_manager is encoders[mc.model_id].batch_manager
               for mc in mcs)
    bad = [
        (f"models: [{{id: a, path: {ckpts['emb']}, task: classification}}]", "models[0].task"),
        (f"models: [{{id: a, path: {ckpts['vit']}, task: embedding}}]", "models[0].task"),
        (f"models: [{{id: a, path: {ckpts['topic']}, task: ranking}}]", "models[0].task"),
    ]
    for i, (text, needle) in enumerate(bad):
        f = tmp_path / f"bad{i}.yaml"
        f.write_text(text + "\n")
        assert main(["serve", "--config", str(f)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="--task"):
        build_config(_parser().parse_args(["serve", ckpts["emb"], "--task", "other=embedding"]))
