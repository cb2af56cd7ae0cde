"""Models loaded and unloaded while `computron serve` serves: Triton's repository API and --model-repository.

The registry's rules (one load for concurrent first requests, 409 for a change of an id under way, a
failed load's error reaching every waiter and the index, unloads of models whose directory went away)
are checked in-process against a stub engine that holds its ``add_model`` on an event: no workers.
The rest runs against one live server started with ``--model-repository`` alone (no model at launch),
a poll period, and an API key, through ``tritonclient.http`` unchanged, the ``openai`` client and
httpx; every answer of a loaded causal LM equals the unsharded transformers model's greedy tokens.
"""
import asyncio
import functools
import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import tritonclient.http as triton
from helpers import greedy_reference
from serve_helpers import ServerProcess, StubEngineBase, write_checkpoints
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from computron import zoo_understanding as zu
from computron.batching.base import SubmitEntry
from computron.engine import EngineSnapshot, ModelSnapshot
from computron.errors import ModelChangeError, ModelConflictError, UnknownModelError
from computron.server.building import BuiltModel, ServedModel
from computron.server.config import ConfigError
from computron.server.model_kind import ModelKind
from computron.server.registry import ModelRegistry
from computron.server.repository import ModelRepository
from computron.batching.text import TextClassificationBatchManager

pytestmark = pytest.mark.timeout(300)

KEY = "sk-repo"
AUTH = {"Authorization": f"Bearer {KEY}"}
N = 8


# ---- the registry against a stub engine (no processes) ------------------------------------------------

class ChangingEngine(StubEngineBase):
    """Serves whatever was added; ``gate`` (an asyncio.Event) holds each add until set, ``entered`` is set
    when one starts, ``fail`` is raised by the next adds."""

    def __init__(self):
        super().__init__("-")
        self.versions, self.calls = {}, []
        self.gate, self.entered, self.fail = None, asyncio.Event(), None

    async def add_model(self, config):
        self.calls.append(("add", config.model_id))
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.versions[config.model_id] = 1

    async def replace_model(self, model_id, config):
        self.calls.append(("replace", model_id))
        self.versions[model_id] += 1

    async def remove_model(self, model_id, drain=True):
        self.calls.append(("remove", model_id))
        del self.versions[model_id]

    def set_pinned(self, model_id, pinned=True):
        self.calls.append(("pinned", model_id, pinned))

    def set_priority(self, model_id, priority):
        self.calls.append(("priority", model_id, priority))

    def snapshot(self):
        return EngineSnapshot(alive=True, dead_reason=None, models={
            m: ModelSnapshot("offloaded", "host", 0, 0, 0, True, False, version=v) for m, v in self.versions.items()})


def stub_build(entry, where=None):
    return BuiltModel(ServedModel(entry.id, entry.path, ModelKind.GENERATION, entry=entry),
                      SimpleNamespace(model_id=entry.id))


def fake_checkpoint(path):
    """What the config checks read of a causal-LM checkpoint: config.json and a tokenizer file."""
    os.makedirs(path)
    for name, body in (("config.json", {"model_type": "opt"}), ("tokenizer.json", {})):
        with open(os.path.join(path, name), "w") as f:
            json.dump(body, f)
    return path


def states(rows):
    return {r["name"]: (r["state"], r["version"], r["reason"]) for r in rows}


@pytest.fixture
def fake_repo(tmp_path):
    repo = tmp_path / "repo"
    fake_checkpoint(str(repo / "r0"))
    return str(repo), fake_checkpoint(str(tmp_path / "x1")), fake_checkpoint(str(tmp_path / "x2"))


def test_concurrent_first_requests_share_one_load_and_other_changes_answer_conflict(fake_repo):
    root, _, _ = fake_repo

    async def go():
        engine = ChangingEngine()
        engine.gate = asyncio.Event()
        reg = ModelRegistry(engine, {}, stub_build, ModelRepository(root))
        await reg.start()
        assert states(await reg.index()) == {"r0": ("", "", "")} and reg.unloaded() == {"r0": f"{root}/r0"}
        waiters = [asyncio.ensure_future(reg.resolve("r0")) for _ in range(4)]
        await engine.entered.wait()  # the one add is under way, every waiter waits on it
        assert reg.loading("r0") and states(await reg.index())["r0"][0] == "LOADING"
        with pytest.raises(ModelConflictError, match="under way"):
            await reg.load("r0", None)
        with pytest.raises(ModelConflictError):
            await reg.unload("r0")
        engine.gate.set()
        got = await asyncio.gather(*waiters)
        assert all(g is got[0] for g in got) and got[0].path == f"{root}/r0"
        assert engine.calls == [("add", "r0")]
        assert states(await reg.index()) == {"r0": ("READY", "1", "")} and not reg.loading("r0")
        with pytest.raises(UnknownModelError):
            await reg.resolve("nope")
    asyncio.run(go())


def test_a_failed_load_reaches_every_waiter_and_the_index_then_a_request_retries(fake_repo):
    root, _, _ = fake_repo

    async def go():
        engine = ChangingEngine()
        engine.fail = ModelChangeError("rank 0 failed to build 'r0': boom")
        reg = ModelRegistry(engine, {}, stub_build, ModelRepository(root))
        await reg.start()
        results = await asyncio.gather(*(reg.resolve("r0") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ModelChangeError) and "could not be loaded" in str(r) and "boom" in str(r)
                   for r in results), results
        assert engine.calls == [("add", "r0")]
        state, _, reason = states(await reg.index())["r0"]
        assert state == "UNAVAILABLE" and "boom" in reason
        engine.fail = None
        assert (await reg.resolve("r0")).id == "r0"
        assert states(await reg.index())["r0"] == ("READY", "1", "")
    asyncio.run(go())


def test_load_replace_unchanged_and_unload(fake_repo):
    root, x1, x2 = fake_repo

    async def go():
        engine = ChangingEngine()
        reg = ModelRegistry(engine, {}, stub_build, ModelRepository(root))
        await reg.start()
        assert await reg.load("x", {"path": x1}) == "added"
        assert await reg.load("x", {"path": x1, "pinned": True, "priority": 3}) == "unchanged"
        assert await reg.load("x", None) == "unchanged"  # served, and no repository directory of that name
        assert await reg.load("x", {"path": x2}) == "replaced"
        assert engine.calls == [("add", "x"), ("pinned", "x", True), ("priority", "x", 3), ("replace", "x")]
        assert states(await reg.index())["x"] == ("READY", "2", "")
        await reg.unload("x")
        assert "x" not in reg.models and engine.calls[-1] == ("remove", "x")
        assert states(await reg.index())["x"] == ("UNAVAILABLE", "", "unloaded")
        with pytest.raises(UnknownModelError):
            await reg.resolve("x")
        with pytest.raises(UnknownModelError):
            await reg.unload("x")
        with pytest.raises(UnknownModelError, match="no directory 'nope' in the model repository"):
            await reg.load("nope", None)
        with pytest.raises(ConfigError, match=r"parameters\.config\.path: checkpoint directory"):
            await reg.load("y", {"path": x1 + "-missing"})
        with pytest.raises(ConfigError, match=r"parameters\.config\.id='z': differs from the model name 'y'"):
            await reg.load("y", {"id": "z", "path": x1})
    asyncio.run(go())


def test_a_rescan_unloads_the_models_whose_directory_is_gone(fake_repo):
    root, x1, _ = fake_repo

    async def go():
        engine = ChangingEngine()
        reg = ModelRegistry(engine, {}, stub_build, ModelRepository(root))
        await reg.start()
        await reg.resolve("r0")
        await reg.load("x", {"path": x1})  # not from the repository: a rescan leaves it
        fake_checkpoint(os.path.join(root, "r1"))
        await reg.load("alias", {"path": os.path.join(root, "r1")})  # its directory stays: so does it
        shutil.rmtree(os.path.join(root, "r0"))
        await reg.sync_repository()
        assert "r0" not in reg.models and reg.unloaded() == {"r1": f"{root}/r1"} and "alias" in reg.models
        with pytest.raises(UnknownModelError):  # waits for the unload, then finds it gone
            await reg.resolve("r0")
        assert ("remove", "r0") in engine.calls and "x" in reg.models
        assert states(await reg.index())["r0"] == ("UNAVAILABLE", "", "unloaded")
        await reg.stop()
    asyncio.run(go())


def test_config_takes_a_model_repository_alone_and_checks_it(tmp_path, capsys):
    from computron.server.cli import _parser, build_config, main
    (tmp_path / "repo").mkdir()
    cfg = build_config(_parser().parse_args(["serve", "--model-repository", str(tmp_path / "repo"),
                                             "--repository-poll", "2.5"]))
    assert cfg.models == [] and cfg.server.model_repository == str(tmp_path / "repo")
    assert cfg.server.repository_poll_s == 2.5
    both = build_config(_parser().parse_args(["serve", f"a={fake_checkpoint(str(tmp_path / 'a'))}",
                                              "--model-repository", str(tmp_path / "repo")]))
    assert [m.id for m in both.models] == ["a"] and both.server.repository_poll_s is None
    f = tmp_path / "c.yaml"
    f.write_text(f"server: {{model_repository: {tmp_path / 'repo'}, repository_poll_s: 1}}\n")
    assert build_config(_parser().parse_args(["serve", "--config", str(f)])).server.repository_poll_s == 1
    for argv, needle in ((["serve", "--model-repository", str(tmp_path / "none")], "server.model_repository"),
                         (["serve", "--model-repository", str(tmp_path / "repo"), "--repository-poll", "0"],
                          "server.repository_poll_s=0.0"),
                         (["serve"], "--model-repository")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


# ---- a live server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """m0..m2 (tiny OPT with a tokenizer) outside the repository; the repository holds r0 (a copy of m0)
    and cls (a BERT classifier)."""
    root = tmp_path_factory.mktemp("repo-ckpt")
    paths = write_checkpoints(str(root / "ext"), n=3)
    repo = root / "repo"
    shutil.copytree(paths["m0"], repo / "r0")
    paths["cls"] = zu.save_random_encoder("bert", str(repo / "cls"), "sequence", seed=11,
                                          labels=zu.LABEL_SETS["sentiment"])
    paths["r0"], paths["repo"] = str(repo / "r0"), str(repo)
    return paths


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    srv = ServerProcess(str(tmp_path_factory.mktemp("serve-repo")), {}, engine={"max_loaded": 1},
                        server={"api_keys": [KEY], "model_repository": ckpts["repo"], "repository_poll_s": 0.3})
    yield srv
    rc, left = srv.stop()
    assert not left and rc == 0, srv.log()


@pytest.fixture(scope="module")
def tc(server):
    return triton.InferenceServerClient(server.url[len("http://"):], network_timeout=240)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=240)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=240) as c:
        yield c


@functools.lru_cache(maxsize=None)
def reference_text(path, prompt):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    out = greedy_reference(path, tok(prompt)["input_ids"], N).tolist()
    return tok.decode(out, skip_special_tokens=True)


def complete(client, model, prompt="The engine swaps models"):
    return client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0).choices[0].text


def index(tc):
    return {r["name"]: r for r in tc.get_model_repository_index(headers=AUTH)}


def model_states(http):
    return {m["id"]: m["state"] for m in http.get("/v1/models").json()["data"]}


def metric_models(server, name="computron_model_state"):
    from prometheus_client.parser import text_string_to_metric_families
    fams = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    return {s.labels["model"] for f in fams for s in f.samples if s.name == name}


def wait_for(check, what, timeout=60):
    """Retry ``check()`` against the server until it holds, within a deadline (the poll runs on a period)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)


def test_first_requests_load_a_repository_model_once(server, tc, client, http, ckpts):
    assert tc.get_server_metadata()["extensions"] == ["model_repository"]
    rows = index(tc)
    assert {n: (r["state"], r["version"]) for n, r in rows.items()} == {"r0": ("", ""), "cls": ("", "")}
    assert model_states(http) == {"r0": "unloaded", "cls": "unloaded"}
    assert not tc.is_model_ready("r0", headers=AUTH)
    with ThreadPoolExecutor(3) as pool:  # concurrent first requests: one load, every one answered
        texts = list(pool.map(lambda _: complete(client, "r0"), range(3)))
    assert texts == [reference_text(ckpts["m0"], "The engine swaps models")] * 3
    assert server.log().count("r0: first request: loading it") == 1
    assert index(tc)["r0"]["state"] == "READY" and tc.is_model_ready("r0", headers=AUTH)
    assert model_states(http)["r0"] in ("resident", "offloaded") and "r0" in metric_models(server)
    assert "r0" in [m["id"] for m in httpx.get(server.url + "/api/status").json()["models"]]


def test_v2_infer_loads_a_repository_encoder_and_answers_as_the_unsharded_model(http, tc, ckpts):
    text = "serve many models on shared gpus"
    r = http.post("/v2/models/cls/infer", json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                                           "data": [text]}]})
    assert r.status_code == 200, r.text
    logits = {o["name"]: o for o in r.json()["outputs"]}["logits"]["data"]
    bm = TextClassificationBatchManager.for_checkpoint(ckpts["cls"])
    task, _ = bm.make_batch(deque([SubmitEntry(0, {"text": text})]))
    with torch.inference_mode():
        want = zu.load_encoder(ckpts["cls"])(**{k: v for k, v in task.batch.items() if k != "pooling"}).logits[0]
    torch.testing.assert_close(torch.tensor(logits), want.float(), rtol=1e-5, atol=2e-6)
    assert index(tc)["cls"]["state"] == "READY"


def test_load_replace_and_unload_through_tritonclient(server, tc, client, http, ckpts):
    tc.load_model("x", headers=AUTH, config=json.dumps({"path": ckpts["m1"], "queue_size": 4}))
    assert tc.is_model_ready("x", headers=AUTH) and index(tc)["x"]["version"] == "1"
    assert complete(client, "x") == reference_text(ckpts["m1"], "The engine swaps models")
    same = http.post("/v2/repository/models/x/load",
                     json={"parameters": {"config": json.dumps({"path": ckpts["m1"], "queue_size": 4})}})
    assert same.status_code == 200 and same.json()["outcome"] == "unchanged", same.text
    tc.load_model("x", headers=AUTH, config=json.dumps({"path": ckpts["m2"]}))  # another path: a new version
    assert index(tc)["x"] == {"name": "x", "version": "2", "state": "READY", "reason": ""}
    assert tc.is_model_ready("x", "2", headers=AUTH) and not tc.is_model_ready("x", "1", headers=AUTH)
    assert complete(client, "x", "GPU memory") == reference_text(ckpts["m2"], "GPU memory")
    assert "x" in metric_models(server)
    tc.unload_model("x", headers=AUTH)
    assert index(tc)["x"] == {"name": "x", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
    assert not tc.is_model_ready("x", headers=AUTH) and "x" not in model_states(http)
    assert "x" not in metric_models(server) and "x" not in metric_models(server, "computron_queue_depth")
    assert "x" not in [m["id"] for m in httpx.get(server.url + "/api/status").json()["models"]]
    with pytest.raises(openai.NotFoundError):
        complete(client, "x")
    tc.load_model("r0", headers=AUTH)  # no config: the repository's directory; served already: nothing to do
    assert [r["name"] for r in tc.get_model_repository_index(headers=AUTH, query_params=None)
            if r["state"] == "READY"] == ["cls", "r0"]
    ready = http.post("/v2/repository/index", json={"ready": True}).json()
    assert [r["name"] for r in ready] == ["cls", "r0"]


def test_repository_api_errors(server, tc, ckpts):
    def status(call):
        with pytest.raises(InferenceServerException) as e:
            call()
        return e.value.status(), e.value.message()

    load = functools.partial(tc.load_model, "y", headers=AUTH)
    assert status(lambda: load(config="{not json"))[0] == "400"
    code, msg = status(lambda: load(config=json.dumps({"path": ckpts["m1"], "colour": "red"})))
    assert code == "400" and "parameters.config.colour: unknown field" in msg
    code, msg = status(lambda: load(config=json.dumps({"path": ckpts["m1"] + "-missing"})))
    assert code == "400" and "does not exist" in msg
    code, msg = status(lambda: load(config=json.dumps({"path": ckpts["m1"], "dtype": "float8"})))
    assert code == "400" and "parameters.config.dtype" in msg
    code, msg = status(lambda: tc.load_model("nope", headers=AUTH))
    assert code == "404" and "no directory 'nope' in the model repository" in msg
    code, msg = status(lambda: tc.unload_model("nope", headers=AUTH))
    assert code == "404" and "nope" in msg
    code, msg = status(lambda: load(config=json.dumps({"path": ckpts["m1"]}), files={"file:1/model.bin": b"x"}))
    assert code == "400" and "file overrides" in msg
    for call in (lambda: tc.get_model_repository_index(), lambda: tc.load_model("r0"),
                 lambda: tc.unload_model("r0")):
        code, msg = status(call)
        assert code == "401" and "API key" in msg
    r = httpx.post(server.url + "/v2/repository/index", content=b"[1]", headers=AUTH)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert "y" not in index(tc)  # a refused config leaves no trace


def test_poll_picks_up_a_new_directory_and_unloads_a_removed_one(server, tc, client, http, ckpts):
    repo = ckpts["repo"]
    shutil.copytree(ckpts["m2"], os.path.join(repo, ".r1.partial"))  # hidden while it is copied
    os.rename(os.path.join(repo, ".r1.partial"), os.path.join(repo, "r1"))
    wait_for(lambda: "r1" in model_states(http), "the poll lists r1")  # /v1/models does not rescan
    assert model_states(http)["r1"] == "unloaded"
    assert complete(client, "r1", "x") == reference_text(ckpts["m2"], "x")
    assert index(tc)["r1"]["state"] == "READY"
    shutil.rmtree(os.path.join(repo, "r1"))
    wait_for(lambda: "r1" not in model_states(http), "the poll unloads r1")
    wait_for(lambda: index(tc)["r1"]["state"] == "UNAVAILABLE", "r1 drained and freed")
    assert index(tc)["r1"]["reason"] == "unloaded" and "r1" not in metric_models(server)
    with pytest.raises(openai.NotFoundError):
        complete(client, "r1")
