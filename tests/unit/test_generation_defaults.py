"""A checkpoint's generation_config.json on the master (no process): its EOS ids join config.json's, its
sampling defaults fill only the fields a request leaves unset, and a bad file fails naming the file and field."""
import json
import logging
from collections import deque

import pytest
import torch

from computron import ModelConfig, SubmitEntry, TaskEntry, zoo
from computron.batching.causal_lm import CausalLMBatchManager, batch_manager_for
from computron.batching.generation import (GenerationConfigError, GenerationDefaults, fill, merge_eos,
                                           read_generation_config)
from computron.comm.messages import BatchingDefaults
from computron.server.openai.protocol import engine_request, parse_completion


def _checkpoint(tmp_path, generation=None, raw=None):
    """A directory with a tiny Llama's config.json (eos 2, 64 positions) and, if given, a generation_config.json."""
    zoo.hf_config("llama-tiny", max_positions=64).save_pretrained(str(tmp_path))
    if generation is not None or raw is not None:
        (tmp_path / "generation_config.json").write_text(raw if raw is not None else json.dumps(generation))
    return str(tmp_path)


def _bm(**generation):
    return CausalLMBatchManager(max_batch_size=4, pad_token_id=0, eos_token_id=2, vocab_size=512, max_positions=64,
                                generation=GenerationDefaults.parse(generation, "gc.json"))


# ---- reading the file ---------------------------------------------------------------------------------

def test_parse_takes_sampling_defaults_and_eos():
    g = GenerationDefaults.parse({"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                  "max_new_tokens": 32, "bos_token_id": 1, "transformers_version": "5"}, "f")
    assert g.eos_token_id == (2, 7)
    assert g.request_defaults() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 32}
    assert GenerationDefaults.parse({"eos_token_id": 9}, "f").eos_token_id == (9,)
    assert GenerationDefaults.parse({}, "f").request_defaults() == {}


@pytest.mark.parametrize("values,temperature", [
    ({"do_sample": False, "temperature": 0.6}, 0.0),  # do_sample false: greedy is the default
    ({"do_sample": True}, 1.0),                       # sampling without a temperature: 1
    ({"do_sample": True, "temperature": 0.7}, 0.7),
    ({"temperature": 0.7}, 0.7),                      # no do_sample: the listed temperature
    ({"top_p": 0.9}, None),
])
def test_do_sample_decides_the_default_temperature(values, temperature):
    assert GenerationDefaults.parse(values, "f").temperature == temperature


def test_repetition_penalty_is_a_default():
    g = GenerationDefaults.parse({"repetition_penalty": 1.1, "temperature": 0.5}, "/ck/generation_config.json")
    assert g.ignored == () and g.request_defaults()["repetition_penalty"] == 1.1
    assert "repetition_penalty=1.1" in g.describe() and "temperature=0.5" in g.describe()
    assert "repetition_penalty" not in GenerationDefaults.parse({"repetition_penalty": 1.0}, "f").request_defaults()


def test_missing_file_means_no_defaults(tmp_path):
    assert read_generation_config(str(tmp_path)) is None


def test_file_is_read(tmp_path):
    g = read_generation_config(_checkpoint(tmp_path, {"eos_token_id": [2, 5], "do_sample": False}))
    assert g.eos_token_id == (2, 5) and g.temperature == 0.0
    assert g.source == str(tmp_path / "generation_config.json")


@pytest.mark.parametrize("raw,needle", [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"eos_token_id": "x"}', "eos_token_id='x'"),
    ('{"eos_token_id": [2, -1]}', "eos_token_id=[2, -1]"),
    ('{"eos_token_id": [2, true]}', "eos_token_id=[2, True]"),
    ('{"temperature": -0.5}', "temperature=-0.5: must be a finite number >= 0"),
    ('{"temperature": "hot"}', "temperature='hot'"),
    ('{"top_p": 1.5}', "top_p=1.5: must be a number in (0, 1]"),
    ('{"top_k": 2.5}', "top_k=2.5: must be an int >= 0"),
    ('{"do_sample": "yes"}', "do_sample='yes': must be true or false"),
    ('{"max_new_tokens": 0}', "max_new_tokens=0: must be an int >= 1"),
    ('{"repetition_penalty": 0}', "repetition_penalty=0: must be a number > 0"),
])
def test_invalid_file_names_file_and_field(tmp_path, raw, needle):
    path = _checkpoint(tmp_path, raw=raw)
    with pytest.raises(GenerationConfigError) as err:
        read_generation_config(path)
    assert str(tmp_path / "generation_config.json") in str(err.value)
    assert needle in str(err.value)


def test_invalid_file_fails_the_preflight(tmp_path):
    from computron.preflight import PreflightError, check_added
    path = _checkpoint(tmp_path, raw='{"top_p": 2}')
    with pytest.raises(PreflightError, match=r"model 'm': .*generation_config\.json: top_p=2: must be"):
        check_added(ModelConfig("m", zoo.load_causal_lm, {"path": path}), 1, 1)


# ---- EOS ------------------------------------------------------------------------------------------------

def test_eos_union():
    assert merge_eos(2, [2, 7], None, 9) == [2, 7, 9]
    assert merge_eos([1, 2], 2) == [1, 2]
    assert merge_eos(None, None) == []


def test_every_eos_id_ends_a_sequence():
    bm = _bm(eos_token_id=[2, 7])
    assert bm.eos_token_id == [2, 7]
    assert bm.to_spec(0, bm.prepare({"input_ids": [5, 6]})).eos == (2, 7)
    task, info = bm.make_batch(deque([SubmitEntry(0, {"input_ids": [5], "max_tokens": 4}),
                                      SubmitEntry(1, {"input_ids": [6], "max_tokens": 4})]))
    assert task.batch["eos_token_id"] == [2, 7]
    out = torch.tensor([[30, 7, 31, 32], [40, 41, 2, 42]])
    got = dict(bm.split_batch(TaskEntry(task.uids, out), **info))
    assert got[0].tolist() == [30, 7] and got[1].tolist() == [40, 41, 2]


# ---- defaults only where the request leaves a field unset ------------------------------------------------

def test_defaults_fill_unset_fields_only():
    bm = _bm(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=8)
    unset = bm.prepare({"input_ids": [5, 6]})
    assert (unset["temperature"], unset["top_p"], unset["top_k"], unset["max_tokens"]) == (0.6, 0.9, 20, 8)
    spec = bm.to_spec(0, unset)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.max_tokens) == (0.6, 0.9, 20, 8)
    none = bm.prepare({"input_ids": [5], "temperature": None, "max_tokens": None})  # None is unset too
    assert (none["temperature"], none["max_tokens"]) == (0.6, 8)
    explicit = {"input_ids": [5], "temperature": 0, "top_p": 1.0, "top_k": 0, "max_tokens": 3}
    assert bm.prepare(explicit) == explicit  # explicit values win, 0 included
    assert bm.to_spec(1, bm.prepare(explicit)).temperature == 0.0


def test_greedy_default_from_do_sample_false_and_the_request_may_still_sample():
    bm = _bm(do_sample=False, top_p=0.8)
    assert bm.to_spec(0, bm.prepare({"input_ids": [5]})).temperature == 0.0
    spec = bm.to_spec(1, bm.prepare({"input_ids": [5], "temperature": 0.9}))
    assert (spec.temperature, spec.top_p) == (0.9, 0.8)


def test_default_max_tokens_fits_the_positions_but_an_explicit_one_is_checked():
    bm = _bm(max_new_tokens=100)  # 64 positions
    assert bm.prepare({"input_ids": list(range(3, 63))})["max_tokens"] == 4
    with pytest.raises(ValueError, match="max_tokens=100"):
        bm.prepare({"input_ids": list(range(3, 63)), "max_tokens": 100})


def test_fill_leaves_the_request_alone():
    data = {"input_ids": [1], "top_k": None}
    out = fill(data, GenerationDefaults.parse({"top_k": 5}, "f"), 1, 64)
    assert out == {"input_ids": [1], "top_k": 5} and data == {"input_ids": [1], "top_k": None}
    assert fill(data, None) is data
    full = {"input_ids": [1], "top_k": 2}
    assert fill(full, GenerationDefaults.parse({"top_k": 5}, "f")) is full  # nothing unset: no copy


def test_requests_batch_by_their_filled_sampling_values():
    bm = _bm(temperature=0.5, top_k=3)
    q = deque([SubmitEntry(0, {"input_ids": [5]}), SubmitEntry(1, {"input_ids": [6], "temperature": 0.5}),
               SubmitEntry(2, {"input_ids": [7], "temperature": 1.0})])
    task, _ = bm.make_batch(q)
    assert task.uids == (0, 1) and task.batch["temperature"] == 0.5 and task.batch["top_k"] == 3
    assert [e.uid for e in q] == [2]


# ---- which batch manager a model gets ---------------------------------------------------------------------

BATCHING = BatchingDefaults(pad_token_id=0, eos_token_id=2, vocab_size=512, max_positions=64)


def test_registration_reads_the_checkpoint_and_logs_what_it_took(tmp_path, caplog):
    path = _checkpoint(tmp_path, {"eos_token_id": [2, 9], "temperature": 0.7, "repetition_penalty": 1.2})
    with caplog.at_level(logging.INFO, logger="computron"):
        bm = batch_manager_for(BATCHING, 4, ModelConfig("m", zoo.load_causal_lm, {"path": path}))
    assert bm.eos_token_id == [2, 9] and bm.generation.temperature == 0.7
    line = [r for r in caplog.records if r.name == "computron.batching.causal_lm"][-1]
    assert line.levelno == logging.INFO
    for needle in ("model 'm'", "generation_config.json", "[2, 9]", "temperature=0.7", "repetition_penalty=1.2"):
        assert needle in line.getMessage()


def test_registration_without_a_checkpoint_takes_what_workers_report(tmp_path):
    from transformers import GenerationConfig
    reported = BatchingDefaults.from_config(zoo.hf_config("llama-tiny"),
                                            GenerationConfig(eos_token_id=[2, 11], top_k=4))
    assert reported.generation == {"eos_token_id": [2, 11], "top_k": 4}
    bm = batch_manager_for(reported, 4, ModelConfig("r", zoo.random_causal_lm, {"name": "llama-tiny"}))
    assert bm.eos_token_id == [2, 11] and bm.generation.top_k == 4
    plain = batch_manager_for(BATCHING, 4, ModelConfig("r", zoo.random_causal_lm, {"name": "llama-tiny"}))
    assert plain.generation is None and plain.eos_token_id == [2]
    own = CausalLMBatchManager(eos_token_id=3)
    assert batch_manager_for(BATCHING, 4, ModelConfig("o", zoo.random_causal_lm, {}, batch_manager=own)) is own


def test_for_checkpoint(tmp_path):
    bm = CausalLMBatchManager.for_checkpoint(_checkpoint(tmp_path, {"eos_token_id": 8, "top_p": 0.5}), 2)
    assert bm.eos_token_id == [2, 8] and bm.generation.top_p == 0.5 and bm.max_batch_size == 2


# ---- the OpenAI routes' requests -------------------------------------------------------------------------

def test_openai_request_takes_generation_defaults_for_unset_fields():
    g = GenerationDefaults.parse({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 50}, "f")
    unset = engine_request(parse_completion({"model": "a", "prompt": "x"}), [5, 6], 16, 32, g)
    assert unset == {"input_ids": [5, 6], "temperature": 0.6, "top_p": 0.9, "max_tokens": 30}  # 32 - 2 positions
    explicit = engine_request(parse_completion({"model": "a", "prompt": "x", "temperature": 0, "top_p": 1,
                                                "max_tokens": 4, "seed": 3}), [5], 16, 32, g)
    assert explicit == {"input_ids": [5], "temperature": 0.0, "top_p": 1.0, "max_tokens": 4, "seed": 3}
    greedy = GenerationDefaults.parse({"do_sample": False}, "f")
    assert engine_request(parse_completion({"model": "a", "prompt": "x"}), [5], 16, 32, greedy)["temperature"] == 0.0


def test_openai_defaults_without_a_generation_config():
    assert engine_request(parse_completion({"model": "a", "prompt": "x"}), [5], 16, 32) == {
        "input_ids": [5], "temperature": 1.0, "max_tokens": 16}


def test_server_build_fails_naming_the_entry_file_and_field(tmp_path, monkeypatch):
    from computron.server import building
    from computron.server.config import ConfigError, parse_model
    monkeypatch.setattr(building, "ModelText", lambda mid, path: None)  # no tokenizer needed here
    path = _checkpoint(tmp_path, raw='{"eos_token_id": [2, "eot"]}')
    (tmp_path / "tokenizer_config.json").write_text("{}")  # what parse_model looks for
    with pytest.raises(ConfigError, match=r"models\[0\]\.path: .*generation_config\.json: eos_token_id="):
        building.build_model(parse_model({"id": "a", "path": path}, "models[0]"), where="models[0]")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7], "top_k": 5}')
    served = building.build_model(parse_model({"id": "a", "path": path}, "models[0]"), where="models[0]").served
    assert served.eos_token_ids == (2, 7) and served.generation.top_k == 5
