"""The sampling controls' checks (one PayloadError naming the field), their SeqSpec fields, each control's
effect on a row of logits (``models.sampling``), resumed sequences, and a core that imports without xgrammar."""
import subprocess
import sys

import pytest
import torch

from computron.batching.causal_lm import CausalLMBatchManager
from computron.comm.messages import SeqSpec
from computron.errors import PayloadError
from computron.models.sampling import SeqSampler, pick, prompt_logprobs, token_logprob


def _bm(**kw):
    return CausalLMBatchManager(eos_token_id=2, vocab_size=50, max_positions=64, **kw)


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.01), ("presence_penalty", float("nan")), ("frequency_penalty", -3),
    ("frequency_penalty", True), ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("min_p", 1.1),
    ("min_p", "0.5"), ("logit_bias", [1, 2]), ("logit_bias", {"x": 1.0}), ("logit_bias", {"50": 1.0}),
    ("logit_bias", {"3": 100.5}), ("logit_bias", {3: float("inf")}), ("min_tokens", -1), ("min_tokens", 1.5),
    ("min_tokens", 9), ("ignore_eos", 1), ("stop_token_ids", 5), ("stop_token_ids", [1, 50]),
    ("stop_token_ids", ["a"]), ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("prompt_logprobs", 2.0),
    ("grammar", "json"), ("grammar", {"type": "yaml"}), ("grammar", {"type": "regex"}),
    ("grammar", {"type": "json_schema", "schema": "x"}), ("grammar", {"type": "json_object", "extra": 1}),
    ("grammar", {"type": "json_object"}),  # no tokenizer to compile with
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(PayloadError) as info:
        _bm().validate({"input_ids": [1, 2, 3], "max_tokens": 8, field: value})
    assert info.value.param == field


def test_good_values_become_spec_fields():
    data = {"input_ids": [1, 2, 3], "max_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.1, "logit_bias": {"7": -3, 4: 2.5}, "min_p": 0.1, "min_tokens": 2,
            "ignore_eos": True, "stop_token_ids": [9, 9, 4], "logprobs": 3, "prompt_logprobs": 0}
    bm = _bm()
    bm.validate(data)
    spec = bm.to_spec(5, data)
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (0.5, -0.25, 1.1)
    assert spec.logit_bias == ((4, 2.5), (7, -3.0)) and spec.stop_token_ids == (9, 4)
    assert (spec.min_p, spec.min_tokens, spec.ignore_eos, spec.logprobs, spec.prompt_logprobs) == (0.1, 2, True, 3, 0)
    assert spec.has_controls and not bm.to_spec(6, {"input_ids": [1], "logprobs": 2}).has_controls


def test_request_level_models_refuse_controls():
    bm = _bm()
    bm.request_level = True
    bm.validate({"input_ids": [1, 2], "repetition_penalty": 1.0, "ignore_eos": False})  # off: accepted
    with pytest.raises(PayloadError) as info:
        bm.validate({"input_ids": [1, 2], "min_tokens": 2})
    assert info.value.param == "min_tokens"


def _spec(**kw):
    return SeqSpec(sid=kw.pop("sid", 0), prompt=kw.pop("prompt", (1, 3, 3)), max_tokens=10, eos=(2,), **kw)


def test_each_control_on_a_row_of_logits():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0])
    # repetition over prompt (1, 3) and generated (4): positive / p, negative * p
    st = SeqSampler(_spec(repetition_penalty=2.0, prompt=(1, 3, 4), generated=1), None)
    assert st.process(logits).tolist() == [0.0, 0.5, 2.0, -2.0, 0.25, 3.0]
    # frequency / presence over the generated tokens only (the resumed spec's last 2 tokens: 5, 5)
    st = SeqSampler(_spec(frequency_penalty=0.5, presence_penalty=1.0, prompt=(1, 5, 5), generated=2), None)
    assert st.process(logits).tolist() == [0.0, 1.0, 2.0, -1.0, 0.5, 1.0]
    st = SeqSampler(_spec(logit_bias=((0, 5.0), (5, -100.0))), None)
    assert st.process(logits).tolist() == [5.0, 1.0, 2.0, -1.0, 0.5, -97.0]
    # min_tokens masks EOS and stop ids until reached; ignore_eos leaves EOS to the model
    st = SeqSampler(_spec(min_tokens=1, stop_token_ids=(4,)), None)
    assert st.process(logits)[[2, 4]].tolist() == [float("-inf")] * 2
    st.accept(1)
    assert st.process(logits).tolist() == logits.tolist()
    st = SeqSampler(_spec(min_tokens=1, ignore_eos=True), None)
    assert st.process(logits)[2] == 2.0
    # min_p drops tokens under min_p * the likeliest (after temperature): only 5 and 2 stay
    g = torch.Generator().manual_seed(0)
    st = SeqSampler(_spec(min_p=0.3, temperature=1.0, seed=0), g)
    assert {st.draw(st.process(logits)) for _ in range(50)} == {2, 5}


def test_endings_and_logprobs():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.5], [0.0, 1.0, 9.0, 0.5], [0.0, 1.0, 9.0, 0.5]])
    specs = [_spec(sid=0), _spec(sid=1, ignore_eos=True, logprobs=2), _spec(sid=2, stop_token_ids=(1,),
                                                                           logit_bias=((2, -20.0),))]
    samplers = {s.sid: SeqSampler(s, None) for s in specs}
    tokens, ids, ends, lps = pick(logits, specs, samplers, {})
    assert tokens.tolist() == ids == [2, 2, 1] and ends == [True, False, True]
    lp = torch.log_softmax(logits[0], -1)
    assert lps[0] is None and lps[2] is None
    assert lps[1][0] == pytest.approx(float(lp[2])) and [t for t, _ in lps[1][1]] == [2, 1]
    assert token_logprob(logits[0], 3, 0) == (pytest.approx(float(lp[3])), ())
    entries = prompt_logprobs(logits[:2], (7, 2, 1), 1)
    assert entries[0] is None and entries[1][:2] == (2, pytest.approx(float(lp[2])))
    assert entries[2][2] == ((2, pytest.approx(float(lp[2]))),)


def test_the_core_imports_and_serves_without_xgrammar():
    code = ("import sys; sys.modules['xgrammar'] = None\n"
            "import computron, computron.engine, computron.models.causal_lm, computron.models.sampling\n"
            "from computron.batching.causal_lm import CausalLMBatchManager\n"
            "from computron.errors import PayloadError\n"
            "bm = CausalLMBatchManager(vocab_size=50, tokenizer_path='/nonexistent')\n"
            "bm.validate({'input_ids': [1, 2], 'repetition_penalty': 1.2})\n"
            "try:\n"
            "    bm.validate({'input_ids': [1, 2], 'grammar': {'type': 'json_object'}})\n"
            "except PayloadError as e:\n"
            "    assert e.param == 'grammar' and 'xgrammar' in str(e), e\n"
            "    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_generation_config_repetition_penalty_is_the_default():
    bm = _bm(generation={"repetition_penalty": 1.3})
    assert bm.to_spec(0, {"input_ids": [1, 2]}).repetition_penalty == 1.3
    assert bm.to_spec(1, {"input_ids": [1, 2], "repetition_penalty": 1.0}).repetition_penalty == 1.0


def test_prompt_logprobs_alone_give_token_logprobs_without_alternatives():
    import asyncio

    from computron.engine.protocol import PromptLogprobs, TokenLogprob
    from computron.engine.sequences import Request
    spec = _spec(prompt_logprobs=1)
    lps = pick(torch.tensor([[0.0, 1.0, 9.0]]), [spec], {0: SeqSampler(spec, None)}, {}).logprobs
    assert lps[0][1] == ()

    async def go():
        loop = asyncio.get_running_loop()
        req = Request(0, "m", loop.create_future(), loop, 0.0, 0.0, stream=asyncio.Queue(), spec=spec)
        req.push([2], list(lps), prompt=(None, (3, -1.5, ((3, -1.5),))))
        return await req.stream.get(), req.tokens

    items, tokens = asyncio.run(go())
    assert tokens == [2]
    assert items == [PromptLogprobs((None, TokenLogprob(3, -1.5, ((3, -1.5),)))), TokenLogprob(2, lps[0][0], ())]
