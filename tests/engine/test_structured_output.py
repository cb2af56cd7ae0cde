"""Structured output through the engine: grammar masks (xgrammar) make random weights write valid JSON, regex
and EBNF, also when their sequences are preempted and recomputed; a grammar that cannot compile fails on the
master, naming the field."""
import asyncio
import json
import re

import pytest

from computron import EngineConfig, LaunchEngine, ModelConfig, PayloadError, zoo
from computron.testing import tokenizer_zoo

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(400)

SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
     "required": ["name", "tags"]},
]


@pytest.fixture(scope="module")
def grammar_ckpt(tmp_path_factory):
    """opt-tiny (512 logits) with a tokenizer of 400 ids: the grammar must mask the ids past its vocabulary."""
    path = str(tmp_path_factory.mktemp("grammar") / "opt")
    return tokenizer_zoo.save_checkpoint_with_tokenizer("opt-tiny", path, seed=1,
                                                        tokenizer=tokenizer_zoo.train_bpe(vocab_size=400))


def test_json_schema_requests_validate(grammar_ckpt):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(grammar_ckpt)
    eos = 2
    jobs = []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        sampling = {"temperature": 1.0, "seed": i} if i % 2 else {}
        jobs.append({"input_ids": [2, 10 + i, 20 + i % 7], "max_tokens": 40,
                     "grammar": {"type": "json_schema", "schema": schema, "strict": True}, **sampling})
    extra = [({"type": "regex", "pattern": "(yes|no)-[0-9]{2}"}, r"(yes|no)-[0-9]{2}"),
             ({"type": "ebnf", "grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= "on" | "off"'}, None),
             ({"type": "json_object"}, None)]

    config = EngineConfig(max_loaded=1, max_batch_size=16, policy="quantum", quantum_ms=5, kv_swap="recompute")
    models = [ModelConfig("g", zoo.load_causal_lm, {"path": grammar_ckpt}),
              ModelConfig("h", zoo.load_causal_lm, {"path": grammar_ckpt})]

    async def go():
        async with LaunchEngine(config, models, 1, 1) as engine:
            outs = await asyncio.gather(*[engine.submit("g", d) for d in jobs])
            # again, each model's turn ending every few steps: the sequences are dropped and recomputed,
            # their grammar matchers rebuilt from the tokens they had accepted
            again = await asyncio.gather(*[engine.submit(m, d) for d in jobs[:12] for m in "gh"])
            assert [a.tolist() for a in again] == [o.tolist() for o in outs[:12] for _ in "gh"]
            assert sum(p.recomputed for p in engine.metrics("preemption")) > 0
            others = await asyncio.gather(*[engine.submit("g", {"input_ids": [2, 30], "max_tokens": 30,
                                                                "grammar": g}) for g, _ in extra])
            with pytest.raises(PayloadError) as info:
                await engine.submit("g", {"input_ids": [2, 5], "grammar": {"type": "regex", "pattern": "[a-"}})
            assert info.value.param == "grammar"
            with pytest.raises(PayloadError) as info:
                await engine.submit("g", {"input_ids": [2, 5], "grammar": {"type": "json_schema",
                                                                           "schema": {"type": "nonsense"}}})
            assert info.value.param == "grammar"
            return outs, others

    outs, others = asyncio.run(go())
    finished = 0
    for d, out in zip(jobs, outs):
        toks = out.tolist()
        assert all(t < 400 for t in toks)  # no id past the tokenizer's vocabulary
        if toks and toks[-1] == eos:  # ended by the grammar (its stop token), not by max_tokens
            finished += 1
            value = json.loads(tok.decode(toks[:-1]))
            jsonschema.validate(value, d["grammar"]["schema"])
    assert finished >= 40, finished
    texts = [tok.decode(o.tolist()[:-1]) for o in others]
    assert all(o.tolist()[-1] == eos for o in others[:2]), texts
    assert re.fullmatch(extra[0][1], texts[0])
    assert re.fullmatch(r"\[(on|off)(,(on|off))*\]", texts[1])
    # any JSON object: random weights write long keys, which may not close within max_tokens
    assert isinstance(json.loads(texts[2]), dict) if others[2].tolist()[-1] == eos else texts[2].startswith("{")
