"""LoRA adapters through `computron serve`'s doors: YAML entries, vLLM's load/unload routes, Triton's load,
``/v1/models``, ``/metrics`` and the status page.

The config checks and the routes' body checks run in-process (the routes against a stub engine: no
workers). The rest runs against one live server (a tiny OPT base and one YAML adapter, an API key) through
the official ``openai`` client and httpx; every adapter's greedy answer equals transformers + PEFT's for that
adapter merged into the unsharded base, detokenized with the base's tokenizer.
"""
import functools
import json
import os
from types import SimpleNamespace

import httpx
import openai
import pytest
from helpers import greedy_reference
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import ServerProcess, StubEngineBase, app_in_thread, write_checkpoints
from transformers import AutoTokenizer

from computron import zoo
from computron.server import create_app
from computron.server.building import ServedModel
from computron.server.config import ConfigError, ServerSettings, from_mapping
from computron.server.model_kind import ModelKind
from computron.testing.zoo_lora import save_random_lora

pytestmark = pytest.mark.timeout(300)

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
N = 8
PROMPT = "The engine swaps models"


# ---- config entries and route bodies, no workers ----------------------------------------------------------

def fake_checkpoint(path, model_type="opt"):
    """What the config checks read of a checkpoint: config.json (and a tokenizer file for a causal LM)."""
    os.makedirs(path)
    for name, body in (("config.json", {"model_type": model_type}), ("tokenizer.json", {})):
        with open(os.path.join(path, name), "w") as f:
            json.dump(body, f)
    return path


def test_yaml_adapter_entries_are_checked_naming_the_field(tmp_path):
    opt, bert = fake_checkpoint(str(tmp_path / "opt")), fake_checkpoint(str(tmp_path / "bert"), "bert")
    base = {"id": "opt", "path": opt}
    cfg = from_mapping({"models": [{"id": "ft", "base": "opt", "adapter": "lora/ft"}, base]})
    ft = cfg.models[0]
    assert (ft.base, ft.adapter, ft.path, ft.kind) == ("opt", os.path.abspath("lora/ft"), None, ModelKind.GENERATION)
    for entries, needle in (
            ([base, {"id": "ft", "base": "nope", "adapter": "a"}], "models[1].base='nope': not a model of this file "
                                                                    "(its models: opt)"),
            ([base, {"id": "ft", "base": "opt"}], "models[1].adapter: missing"),
            ([base, {"id": "ft", "adapter": "a"}], "models[1].base: missing"),
            ([base, {"id": "ft", "base": "opt", "adapter": "a", "path": opt}], "models[1].path: not a field of a "
                                                                                "LoRA adapter entry"),
            ([base, {"id": "ft", "base": "opt", "adapter": "a", "dtype": "float16"}], "set it on the base"),
            ([base, {"id": "ft", "base": "opt", "adapter": 3}], "models[1].adapter=3: must be a string"),
            ([base, {"id": "opt", "base": "opt", "adapter": "a"}], "models[1].id='opt': duplicate model id"),
            ([{"id": "ft", "base": "ft", "adapter": "a"}], "models[0].base='ft': an adapter runs on another model"),
            ([base, {"id": "a1", "base": "opt", "adapter": "a"}, {"id": "a2", "base": "a1", "adapter": "b"}],
             "models[2].base='a1': an adapter itself"),
            ([{"id": "emb", "path": bert}, {"id": "ft", "base": "emb", "adapter": "a"}],
             "models[1].base='emb': a embedding model; LoRA adapters run on causal LMs")):
        with pytest.raises(ConfigError) as e:
            from_mapping({"models": entries})
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


class AdapterEngine(StubEngineBase):
    """Records adapter changes; serves the stub's one model."""

    def __init__(self):
        super().__init__("opt")
        self.calls = []

    async def add_model(self, config):
        self.calls.append(("add", config.model_id, config.base, config.adapter))

    async def remove_model(self, model_id, drain=True):
        self.calls.append(("remove", model_id))


def stub_app(*bases):
    models = {b: ServedModel(b, f"/ckpt/{b}", ModelKind.GENERATION, text=SimpleNamespace(), max_positions=64)
              for b in bases}
    engine = AdapterEngine()
    return engine, create_app(engine, models=models, settings=ServerSettings(api_keys=[KEY]))


def test_lora_routes_check_the_key_and_the_body():
    engine, app = stub_app("opt", "other")
    with app_in_thread(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        def err(path, body, status, param=None, headers=None):
            r = http.post(path, json=body, headers=headers)
            assert r.status_code == status, r.text
            e = r.json()["error"]
            assert set(e) == {"message", "type", "param", "code"} and e["param"] == param, e
            return e["message"]
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert "API key" in err(path, {"lora_name": "a", "lora_path": "/x"}, 401, headers={"Authorization": ""})
        assert "lora_name: a non-empty string is required" in err("/v1/load_lora_adapter", {"lora_path": "/x"}, 400,
                                                                 "lora_name")
        assert "lora_path" in err("/v1/load_lora_adapter", {"lora_name": "a"}, 400, "lora_path")
        assert "must be a model id" in err("/v1/load_lora_adapter", {"lora_name": " a", "lora_path": "/x"}, 400,
                                           "lora_name")
        assert "colour: unknown field" in err("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x",
                                                                        "colour": 1}, 400, "colour")
        msg = err("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, 400, "base")
        assert "name the served model the adapter runs on (causal LMs served: opt, other)" in msg
        assert "already served" in err("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": "/x",
                                                                 "base": "opt"}, 409, "lora_name")
        assert "base model 'nope' of adapter 'a' is not served" in err(
            "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "base": "nope"}, 404, "base")
        assert "only false" in err("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "base": "opt",
                                                             "load_inplace": True}, 400, "load_inplace")
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "rel/a", "base": "opt"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully.", r.text
        assert engine.calls == [("add", "a", "opt", os.path.abspath("rel/a"))]
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert (models["a"]["parent"], models["a"]["root"], models["opt"]["parent"]) == ("opt",
                                                                                       os.path.abspath("rel/a"), None)
        assert "not a LoRA adapter" in err("/v1/unload_lora_adapter", {"lora_name": "opt"}, 400, "lora_name")
        assert "LoRA adapter 'b' is not served (adapters served: ['a'])" in err(
            "/v1/unload_lora_adapter", {"lora_name": "b"}, 404, "lora_name")
        r = http.post("/v2/repository/models/opt/unload")  # its adapter first
        assert r.status_code == 409 and "adapters ['a']" in r.json()["error"], r.text
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a", "lora_int_id": 1})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully.", r.text
        assert engine.calls[-1] == ("remove", "a") and "a" not in app.state.computron.models
        assert http.post("/v2/repository/models/opt/unload").status_code == 200


# ---- a live server -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny OPT base with a tokenizer, three adapters for it (sql in the YAML, chat loaded later, r=4;
    twin: a copy of chat for Triton's load) and one made for a tiny Llama."""
    root = tmp_path_factory.mktemp("lora-ckpt")
    paths = {"opt": write_checkpoints(str(root / "base"), n=1)["m0"]}
    paths["sql"] = save_random_lora(paths["opt"], str(root / "sql"), seed=1)
    paths["chat"] = save_random_lora(paths["opt"], str(root / "chat"), seed=2, r=4)
    llama = zoo.save_random_causal_lm("llama-tiny", str(root / "llama"), seed=0)
    paths["llama-lora"] = save_random_lora(llama, str(root / "llama-lora"), seed=3)
    return paths


def test_a_yaml_adapter_that_does_not_fit_its_base_stops_serve_before_any_worker(ckpts, tmp_path, capsys):
    import yaml

    from computron.server.cli import main
    for adapter, needle in ((ckpts["llama-lora"], "models[1].adapter: adapter 'ft': targets module"),
                            (str(tmp_path / "none"), "models[1].adapter: adapter 'ft': directory")):
        f = tmp_path / "serve.yaml"
        f.write_text(yaml.safe_dump({"models": [{"id": "opt", "path": ckpts["opt"]},
                                                {"id": "ft", "base": "opt", "adapter": adapter}],
                                     "server": {"port": 0}}))
        assert main(["serve", "--config", str(f)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    srv = ServerProcess(str(tmp_path_factory.mktemp("serve-lora")),
                        {"opt": ckpts["opt"], "opt-sql": {"base": "opt", "adapter": ckpts["sql"]}},
                        engine={"max_loaded": 1}, server={"api_keys": [KEY]})
    yield srv
    rc, left = srv.stop()
    assert not left and rc == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@functools.lru_cache(maxsize=None)
def reference_text(base, adapter, prompt=PROMPT):
    """transformers + PEFT: the adapter merged into the unsharded base, greedy, detokenized."""
    from peft import PeftModel
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = zoo.load_causal_lm(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = greedy_reference(model.eval(), tok(prompt)["input_ids"], N).tolist()
    return tok.decode(out, skip_special_tokens=True)


def complete(client, model, prompt=PROMPT, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, **kw)


def listed(http):
    return {m["id"]: m for m in http.get("/v1/models").json()["data"]}


def samples(server, name):
    fams = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    return [s for f in fams for s in f.samples if s.name == name]


def test_a_yaml_adapter_answers_as_peft_and_the_bare_base_differs(client, ckpts):
    want = reference_text(ckpts["opt"], ckpts["sql"])
    assert want != reference_text(ckpts["opt"], None), "the adapter must change the answer"
    assert complete(client, "opt-sql").choices[0].text == want
    assert "".join(c.choices[0].text for c in complete(client, "opt-sql", stream=True)) == want
    assert complete(client, "opt").choices[0].text == reference_text(ckpts["opt"], None)


def test_models_metrics_and_status_list_the_adapter_with_its_base(server, client, http, ckpts):
    complete(client, "opt-sql")  # the base is resident now: so is the adapter
    models = listed(http)
    assert (models["opt-sql"]["parent"], models["opt-sql"]["root"]) == ("opt", ckpts["sql"])
    assert (models["opt"]["parent"], models["opt"]["root"]) == (None, ckpts["opt"])
    assert models["opt-sql"]["state"] == models["opt"]["state"] == "resident"
    assert client.models.retrieve("opt-sql").parent == "opt"
    rows = {m["id"]: m for m in httpx.get(server.url + "/api/status").json()["models"]}
    assert rows["opt-sql"]["base"] == "opt" and rows["opt"]["base"] is None
    assert rows["opt-sql"]["state"] == rows["opt"]["state"] == "resident"
    assert [(s.labels, s.value) for s in samples(server, "computron_lora_adapter")] == [
        ({"model": "opt-sql", "base": "opt"}, 1.0)]
    assert [s.value for s in samples(server, "computron_resident_models")] == [1.0]  # the base alone
    assert {s.labels["model"] for s in samples(server, "computron_swaps_total")} == {"opt"}
    resident = {s.labels["model"] for s in samples(server, "computron_model_resident") if s.value == 1}
    assert resident == {"opt", "opt-sql"}
    ok = [s for s in samples(server, "computron_requests_total") if s.labels["model"] == "opt-sql"
          and s.labels["outcome"] == "ok"]
    assert ok and ok[0].value >= 1


def test_load_use_and_unload_an_adapter_while_serving(client, http, ckpts):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "opt-chat", "lora_path": ckpts["chat"]})  # no base
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'opt-chat' added successfully.", r.text
    want = reference_text(ckpts["opt"], ckpts["chat"])
    assert want != reference_text(ckpts["opt"], ckpts["sql"])
    assert complete(client, "opt-chat").choices[0].text == want
    assert (listed(http)["opt-chat"]["parent"], listed(http)["opt-chat"]["root"]) == ("opt", ckpts["chat"])
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "opt-chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'opt-chat' removed successfully.", r.text
    assert "opt-chat" not in listed(http)
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "opt-chat")
    assert e.value.code == "model_not_found"
    # Triton's load takes the same entry fields; the adapter and its base keep answering meanwhile
    r = http.post("/v2/repository/models/twin/load",
                  json={"parameters": {"config": json.dumps({"base": "opt", "adapter": ckpts["chat"]})}})
    assert r.status_code == 200 and r.json()["outcome"] == "added", r.text
    assert complete(client, "twin").choices[0].text == want
    assert complete(client, "opt-sql").choices[0].text == reference_text(ckpts["opt"], ckpts["sql"])
    assert http.post("/v2/repository/models/twin/unload").status_code == 200


def test_load_lora_adapter_errors(server, http, ckpts):
    def err(body, status, headers=None):
        r = http.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == status, r.text
        return r.json()["error"]
    e = err({"lora_name": "gone", "lora_path": ckpts["chat"] + "-missing", "base": "opt"}, 400)
    assert e["code"] == "invalid_adapter" and e["param"] == "lora_path" and "adapter 'gone'" in e["message"]
    assert "does not exist" in e["message"] and "\n" not in e["message"]
    e = err({"lora_name": "llama-ft", "lora_path": ckpts["llama-lora"]}, 400)
    assert e["code"] == "invalid_adapter" and "adapter 'llama-ft'" in e["message"], e
    e = err({"lora_name": "x", "lora_path": ckpts["chat"], "base": "llama"}, 404)
    assert e["code"] == "model_not_found" and e["param"] == "base" and "'llama'" in e["message"]
    for used in ("opt-sql", "opt"):
        e = err({"lora_name": used, "lora_path": ckpts["chat"]}, 409)
        assert e["code"] == "model_conflict" and e["param"] == "lora_name"
    assert err({"lora_path": ckpts["chat"]}, 400)["param"] == "lora_name"
    assert err({"lora_name": "y", "lora_path": ckpts["chat"]}, 401, {"Authorization": "Bearer wrong"})["code"] == \
        "invalid_api_key"
    r = http.post("/v2/repository/models/opt/unload")  # a base with adapters stays
    assert r.status_code == 409 and "opt-sql" in r.json()["error"]
    assert set(listed(http)) == {"opt", "opt-sql"}  # nothing refused left a trace
