"""The batched sampler (``models.sampling``): each control and their mixes in one batch equal the rows sampled
alone by the Python reference (``sampling_reference``: one row, one token at a time, one ``multinomial`` per
draw); a seeded row draws the same tokens whatever its batch mates and its place among them; logprobs of the
rows that ask; and a decode step of a real runner copies only ids (and asked-for logprobs) to the host."""
import random

import pytest
import torch
import torch.distributed as dist
from sampling_reference import controlled, drawn

from computron import ModelConfig
from computron.comm import messages as msg
from computron.comm.topology import Layout
from computron.models import StageContext, make_runner
from computron.models.sampling import SeqSampler, pick, prompt_logprobs, seq_generator
from computron.testing.zoo import random_causal_lm

VOCAB = 64
EOS = 2
CONTROLS = [
    {},
    {"temperature": 0.7, "seed": 1},
    {"temperature": 1.3, "top_k": 5, "seed": 2},
    {"temperature": 1.0, "top_p": 0.6, "seed": 3},
    {"temperature": 1.1, "min_p": 0.2, "seed": 4},
    {"temperature": 0.9, "top_k": 12, "top_p": 0.8, "min_p": 0.05, "seed": 5},
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.6, "temperature": 1.2, "seed": 6},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7, "temperature": 1.0, "seed": 7},
    {"logit_bias": ((7, 6.0), (11, -100.0), (40, 2.5))},
    {"logit_bias": ((EOS, 9.0),), "min_tokens": 3, "stop_token_ids": (9,)},
    {"logit_bias": ((EOS, 9.0),), "ignore_eos": True, "temperature": 0.8, "top_k": 1},
    {"frequency_penalty": -1.0, "logit_bias": ((3, 1.0),), "min_p": 0.3, "temperature": 1.5, "seed": 8},
]


def _spec(sid, prompt, **kw):
    return msg.SeqSpec(sid=sid, prompt=tuple(prompt), max_tokens=50, eos=(EOS,), **kw)


def _alone(spec, steps_logits):
    """What ``sampling_reference`` picks for ``spec`` on its own rows of logits, step after step."""
    kw = {k: getattr(spec, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")}
    stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(spec.eos))
    g = torch.Generator().manual_seed(spec.seed)
    gen = []
    for raw in steps_logits:
        x = controlled(raw, spec.prompt, gen, stops, logit_bias=dict(spec.logit_bias), **kw)
        gen.append(drawn(x, g, spec.temperature, spec.top_k, spec.top_p, spec.min_p))
    return gen


def _serve(specs, steps_logits):
    """Tokens per sid of ``pick`` over the batch, step after step (``steps_logits[t]`` [B, V] in specs' order)."""
    samplers = {s.sid: SeqSampler(s, seq_generator(s)) for s in specs}
    gens = {s.sid: samplers[s.sid].generator for s in specs}
    out = {s.sid: [] for s in specs}
    for logits in steps_logits:
        got = pick(logits, specs, samplers, gens)
        assert got.tokens.tolist() == got.ids
        for s, t in zip(specs, got.ids):
            out[s.sid].append(t)
    return out


def _logits(rows, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, VOCAB, generator=g) * 3 for _ in range(steps)]


def test_a_batch_mixing_every_control_equals_each_row_alone():
    specs = [_spec(i, [1, 5 + i, 7, 7, 30 + i], **c) for i, c in enumerate(CONTROLS)]
    steps = _logits(len(specs), 8, seed=0)
    got = _serve(specs, steps)
    for i, s in enumerate(specs):
        assert got[s.sid] == _alone(s, [x[i] for x in steps]), CONTROLS[i]
    assert len({tuple(v) for v in got.values()}) > len(specs) // 2, "the rows differ: each took its own controls"


def test_a_seeded_row_ignores_its_batch_mates_and_its_place():
    mine = _spec(100, [1, 4, 4], temperature=1.0, top_p=0.9, frequency_penalty=0.3, seed=42)
    own = _logits(1, 10, seed=5)
    results = []
    for mates, place in ((0, 0), (3, 1), (7, 7), (5, 2)):
        others = [_spec(j, [1, j], **CONTROLS[(j * 3 + place) % len(CONTROLS)]) for j in range(mates)]
        specs = others[:place] + [mine] + others[place:]
        noise = _logits(len(specs), 10, seed=mates + 10)
        steps = [torch.cat([n[:place], x, n[place + 1:]]) for n, x in zip(noise, own)]
        results.append(_serve(specs, steps)[mine.sid])
    assert all(r == results[0] for r in results), results
    assert results[0] == _alone(mine, [x[0] for x in own])
    other_seed = _serve([_spec(100, [1, 4, 4], temperature=1.0, top_p=0.9, frequency_penalty=0.3, seed=43)], own)
    assert other_seed[100] != results[0], "another seed draws otherwise"


def test_rows_without_a_generator_share_the_default_one():
    specs = [_spec(i, [1], temperature=1.0, top_k=3) for i in range(4)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    got = pick(logits, specs, {s.sid: SeqSampler(s, None) for s in specs}, {})
    assert all(t in torch.topk(logits[i], 3).indices.tolist() for i, t in enumerate(got.ids))


def test_logprobs_of_the_rows_that_ask():
    specs = [_spec(0, [1]), _spec(1, [1], logprobs=3), _spec(2, [1], prompt_logprobs=1),
             _spec(3, [1], logprobs=0, temperature=1.0, seed=1)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    samplers = {s.sid: SeqSampler(s, seq_generator(s)) for s in specs}
    got = pick(logits, specs, samplers, {s: st.generator for s, st in samplers.items()})
    lp = torch.log_softmax(logits, -1)
    assert got.logprobs[0] is None
    for i, k in ((1, 3), (2, 0), (3, 0)):
        value, top = got.logprobs[i]
        assert value == pytest.approx(float(lp[i, got.ids[i]]), abs=1e-6)
        vals, ids = torch.topk(lp[i], k)
        assert [t for t, _ in top] == ids.tolist() and [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)
    entries = prompt_logprobs(logits[:2], (9, 5, 6), 2)
    assert entries[0] is None and [e[0] for e in entries[1:]] == [5, 6]
    assert entries[2][1] == pytest.approx(float(lp[1, 6]), abs=1e-6)
    assert [t for t, _ in entries[1][2]] == torch.topk(lp[0], 2).indices.tolist()


def test_ending_ids_masked_until_min_tokens_then_they_end():
    spec = _spec(0, [1], logit_bias=((EOS, 50.0),), min_tokens=2)
    st = SeqSampler(spec, None)
    logits = torch.zeros(1, VOCAB)
    firsts = [pick(logits, [spec], {0: st}, {}) for _ in range(3)]
    assert [f.ids[0] != EOS for f in firsts] == [True, True, False]
    assert [f.ends[0] for f in firsts] == [False, False, True]


class OnlyAllows:
    """A grammar matcher's stand-in: allows ``ids`` next (of a tokenizer of ``vocab`` ids), ends at EOS."""

    def __init__(self, ids, vocab):
        self.ids, self.vocab, self.terminated = ids, vocab, False

    def fill(self, bitmask, row):
        bitmask[row] = 0
        for t in self.ids:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept(self, token):
        self.terminated = token == EOS


def test_grammar_rows_take_their_bitmask_and_win_over_min_tokens():
    pytest.importorskip("xgrammar")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6))
    logits[:, 60] = 50.0  # past the grammar's tokenizer: masked for its rows
    specs = [_spec(0, [1]), _spec(1, [1], min_tokens=3), _spec(2, [1], min_tokens=3),
             _spec(3, [1], temperature=1.0, seed=3, logit_bias=((0, 0.0),))]  # controls, as a grammar has
    samplers = {s.sid: SeqSampler(s, seq_generator(s)) for s in specs}
    allowed = {1: [5, EOS], 2: [EOS], 3: [7, 9, 33]}
    for sid, ids in allowed.items():
        samplers[sid].matcher = OnlyAllows(ids, vocab=48)
    got = pick(logits, specs, samplers, {s.sid: samplers[s.sid].generator for s in specs})
    assert got.ids[0] == 60, "a row without grammar keeps its logits"
    assert got.ids[1] == 5, "min_tokens masks EOS: the grammar's other token"
    assert got.ids[2] == EOS and got.ends[2], "the grammar can only end: it wins over min_tokens"
    assert got.ids[3] in allowed[3]


# ---- host traffic of a decode step ---------------------------------------------------------------------------


class OneRank:
    """What a runner reads of ``topology.Groups`` at TP=PP=1."""

    layout = Layout(1, 1, 1, False)
    rank, stage, tp_rank, tp_group, data = 0, 0, 0, None, None


@pytest.fixture
def one_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


COPIES = ("cpu", "tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__")
"""The ways Python code brings a tensor's values to the host."""


@pytest.mark.parametrize("kv_cache", ["paged", "dynamic"])
def test_a_decode_step_copies_only_ids_and_asked_logprobs_to_the_host(one_group, kv_cache, monkeypatch):
    """Every copy to the host during decode steps of mixed controls is at most a few numbers per row; the
    model's logits ([B, V]) never leave the device. (The device-neutral path: plain attention, no compile.)"""
    model = random_causal_lm("llama-tiny", seed=0)
    vocab = model.config.vocab_size
    ctx = StageContext(OneRank(), torch.device("cpu"), "m", scatter_from=None, kv_cache=kv_cache, kv_block_size=4,
                       pack_linears=False, cpu_attention=False)
    runner = make_runner(model, ModelConfig("m", random_causal_lm, {"name": "llama-tiny"}), ctx)
    rng = random.Random(0)
    admit = tuple(msg.SeqSpec(sid=i, prompt=tuple(rng.randrange(3, vocab) for _ in range(3 + i)), max_tokens=20,
                              eos=(), logprobs=2 if i == 1 else None, **{k: v for k, v in c.items()})
                  for i, c in enumerate(CONTROLS[:8]))
    rows, k = len(admit), 2
    copies = []

    def watch(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, **kw):
            copies.append((name, self.numel(), tuple(self.shape)))
            return original(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)

    with torch.inference_mode():
        first = runner.step(msg.Step(seq=0, model_id="m", admit=admit), lambda: None)
        assert first.running == rows
        for name in COPIES:
            watch(name)
        for seq in range(1, 4):
            res = runner.step(msg.Step(seq=seq, model_id="m"), lambda: None)
            assert len(res.tokens) == rows and res.logprobs[1] is not None and len(res.logprobs[1][1]) == k
    monkeypatch.undo()
    assert copies, "the step brings its tokens to the host"
    biggest = max(n for _, n, _ in copies)
    per_step = sum(n for _, n, _ in copies) / 3
    assert biggest <= rows + 1 + 2 * k, copies
    assert per_step <= rows + 1 + 2 * k + 4, copies  # ids, one row's logprobs, a few flags
    assert biggest < vocab


def test_the_sampler_benchmark_counts_ids_not_logits(capsys):
    """``benchmarks/sampler.py``'s small path: the device path copies the ids and one row's logprobs, the host
    path the whole logits."""
    import json

    from benchmarks import sampler
    assert sampler.main(["--batch", "8", "--vocab", "512", "--steps", "2", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"]["host_bytes_per_step"] == 8 * (8 + 1 + 2 * 5)  # float64: ids, then logprob and top 5
    assert out["host"]["host_bytes_per_step"] >= 8 * 512 * 4
