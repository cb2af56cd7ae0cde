"""LoRA adapters on a served causal LM's shard (issue 20): ``lora.weights`` + ``lora.slots`` against HF+PEFT.

Runners are built in this process as the workers build them (``make_runner`` on a ``StageContext`` whose
groups are stand-ins at TP=1); a batch whose rows run different adapters (and the bare base) goes
through the runner's own stage forward, greedy token by token with its KV cache, and every row must give
what ``PeftModel.from_pretrained(base, adapter)`` gives for that row's prompt alone. Pipeline stages are
chained in-process; TP=2 runs two gloo processes.
"""
import contextlib
import multiprocessing as mp
import os

import pytest
import torch

from computron import ModelConfig, zoo
from computron.lora import AdapterError, check_adapter
from computron.lora.slots import LoraSlots, TooManyAdapters
from computron.lora.weights import load_rank_adapter
from computron.models import StageContext, make_runner
from computron.testing.zoo_lora import save_random_lora
from computron.comm.topology import Layout

pytestmark = pytest.mark.timeout(300)

STEPS = 4
PROMPTS = [[5, 17, 42, 99, 7], [300, 12], [8, 9, 10, 11, 12, 13, 14], [77, 66, 55], [401, 3, 250, 18], [20, 30]]
ROWS = ["a1", "a2", None, "a3", "a4", "a1"]
ADAPTERS = {  # id: (seed, r, alpha, targets, use_rslora); targets "attn-qv" / "mlp" resolved per family
    "a1": (11, 4, 8, None, False),
    "a2": (12, 8, 16, "attn-qv", False),
    "a3": (13, 16, 16, None, True),
    "a4": (14, 2, 4, "mlp", False),
}
MLP = {"opt0": ["fc1", "fc2"], "llama0": ["gate_proj", "up_proj", "down_proj"]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine their spinning costs 30x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class StandInGroups:
    """What a runner reads of ``topology.Groups``: TP=1 needs no process group; TP>1 takes a real one."""

    def __init__(self, layout: Layout, rank: int, tp_group=None):
        self.layout, self.rank, self.tp_group = layout, rank, tp_group

    stage = property(lambda self: self.layout.stage_of(self.rank))
    tp_rank = property(lambda self: self.layout.tp_rank_of(self.rank))


def build_runner(path, tp=1, pp=1, rank=0, tp_group=None):
    layout = Layout(tp, pp, tp * pp, False)
    ctx = StageContext(StandInGroups(layout, rank, tp_group), torch.device("cpu"), "m", scatter_from=None)
    return make_runner(zoo.load_causal_lm(path), ModelConfig("m", zoo.load_causal_lm, {"path": path}), ctx)


def base_config(path):
    import json
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def infos_of(path, adapters):
    """What the master sends the workers: every adapter checked against the base's config.json."""
    return {aid: check_adapter(aid, adir, base_config(path)) for aid, adir in adapters.items()}


def slots_for(runner, infos, max_loras=4, max_rank=16):
    slots = LoraSlots(runner, max_loras, max_rank)
    for aid, info in infos.items():
        slots.add(aid, load_rank_adapter(info, runner, pin=False))
    return slots


def decode(runners, slots, rows, prompts=PROMPTS, steps=STEPS):
    """Greedy ``steps`` tokens for left-padded ``prompts`` through the stage runners in order, each row with
    its adapter: (logits of every step [steps, B, V], tokens [B, steps])."""
    from transformers import DynamicCache
    width = max(len(p) for p in prompts)
    pad = int(runners[0].batching_defaults().pad_token_id)
    cur = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    caches = [DynamicCache() for _ in runners]
    logits, tokens = [], []
    with torch.inference_mode():
        for _ in range(steps):
            x = cur
            with contextlib.ExitStack() as stack:
                for s in slots:
                    stack.enter_context(s.active(rows))
                for runner, cache in zip(runners, caches):
                    x = runner._stage_forward(x, mask, runner._positions(mask, cur.shape[1]), cache)
            logits.append(x.clone())
            tokens.append(x.argmax(-1))
            cur = tokens[-1][:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(logits), torch.stack(tokens, dim=1)


def peft_model(path, adapter_dir):
    """The unsharded HF model, with ``PeftModel.from_pretrained`` of the adapter when one is given."""
    from peft import PeftModel
    model = zoo.load_causal_lm(path)
    return model if adapter_dir is None else PeftModel.from_pretrained(model, adapter_dir).eval()


def reference(model, prompt, steps=STEPS):
    """``model`` on ``prompt`` alone, no cache, greedy: (logits [steps, V], tokens [steps])."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits.append(model(input_ids=torch.tensor([ids])).logits[0, -1].float())
            ids.append(int(logits[-1].argmax()))
    return torch.stack(logits), torch.tensor(ids[len(prompt):])


@pytest.fixture(scope="module")
def lora_setup(checkpoints, tmp_path_factory):
    """Per base (opt0, llama0): its four adapters' directories and every (adapter, prompt) reference."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for base in ("opt0", "llama0"):
        path = checkpoints[base]
        dirs = {}
        for aid, (seed, r, alpha, targets, rslora) in ADAPTERS.items():
            targets = {"attn-qv": ["q_proj", "v_proj"], "mlp": MLP[base]}.get(targets)
            dirs[aid] = save_random_lora(path, str(root / f"{base}-{aid}"), seed=seed, r=r, alpha=alpha,
                                         targets=targets, use_rslora=rslora)
        refs = {}
        for aid in [None, *ADAPTERS]:
            model = peft_model(path, dirs.get(aid))
            refs.update({(aid, i): reference(model, p) for i, p in enumerate(PROMPTS)})
        out[base] = (path, dirs, refs)
    return out


def test_adapters_peft_saved_are_checked_by_their_names_and_shapes(lora_setup):
    """The tensor names and shapes ``check_adapter`` expects are PEFT's own; a Llama adapter's names do not
    fit OPT layers (and the other way round), whatever the widths."""
    (opt, opt_dirs, _), (llama, llama_dirs, _) = lora_setup["opt0"], lora_setup["llama0"]
    info = check_adapter("a3", llama_dirs["a3"], base_config(llama))
    assert (info.r, info.alpha, info.scaling, info.layers) == (16, 16.0, 4.0, (0, 1, 2, 3))
    assert info.target_modules == ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                   "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")
    assert check_adapter("a2", opt_dirs["a2"], base_config(opt)).target_modules == ("self_attn.q_proj",
                                                                                   "self_attn.v_proj")
    with pytest.raises(AdapterError, match="not a LoRA A/B weight of a opt decoder layer"):
        check_adapter("x", llama_dirs["a2"], base_config(opt))  # q_proj/v_proj: names PEFT matches in OPT too
    with pytest.raises(AdapterError, match="not a LoRA A/B weight of a llama decoder layer"):
        check_adapter("x", opt_dirs["a2"], base_config(llama))
    with pytest.raises(AdapterError, match="targets module 'down_proj'"):
        check_adapter("x", llama_dirs["a1"], base_config(opt))


def assert_rows_match(logits, tokens, rows, refs, prompts_idx=None):
    for i, aid in enumerate(rows):
        ref_logits, ref_tokens = refs[(aid, i if prompts_idx is None else prompts_idx[i])]
        assert torch.equal(tokens[i], ref_tokens), (i, aid, tokens[i], ref_tokens)
        torch.testing.assert_close(logits[:, i], ref_logits, atol=2e-4, rtol=1e-4, msg=lambda m: f"row {i} {aid}: {m}")


@pytest.mark.parametrize("base", ["opt0", "llama0"])
def test_mixed_batch_matches_peft_row_by_row(lora_setup, base):
    """Four adapters (ranks 2-16, one rslora, attention-only, MLP-only) and the bare base in one batch."""
    path, dirs, refs = lora_setup[base]
    changed = sum(not torch.equal(refs[(a, i)][1], refs[(None, i)][1]) for a in ADAPTERS for i in range(len(PROMPTS)))
    assert changed >= len(ADAPTERS) * len(PROMPTS) // 2, "the random adapters must change greedy outputs"
    runner = build_runner(path)
    plain_logits, _ = decode([runner], [], [None] * len(PROMPTS))
    slots = slots_for(runner, infos_of(path, dirs))
    logits, tokens = decode([runner], [slots], ROWS)
    assert_rows_match(logits, tokens, ROWS, refs)
    uniform = ["a3"] * len(PROMPTS)  # one adapter for every row: the gather-free path
    assert_rows_match(*decode([runner], [slots], uniform), uniform, refs)
    bare_logits, _ = decode([runner], [slots], [None] * len(PROMPTS))  # hooks installed, none active
    assert torch.equal(bare_logits, plain_logits)
    assert slots.host_bytes() > 0 and slots.device_bytes() > 0


def test_pipeline_stages_apply_their_own_layers(lora_setup):
    """PP=2: each stage's runner keeps only its layers' adapter weights; chained, rows still match PEFT."""
    path, dirs, refs = lora_setup["llama0"]
    runners = [build_runner(path, pp=2, rank=s) for s in range(2)]
    infos = infos_of(path, dirs)
    slots = [slots_for(r, infos) for r in runners]
    for r, s in zip(runners, slots):
        assert r.layer_ids == ([0, 1] if r.ctx.is_first else [2, 3])
        assert {k[0] for k in s._host["a1"].weights} == {0, 1}  # local indices of the stage's layers
    assert slots[0].host_bytes() + slots[1].host_bytes() == sum(i.nbytes for i in infos.values())
    logits, tokens = decode(runners, slots, ROWS)
    assert_rows_match(logits, tokens, ROWS, refs)


def test_slots_lru_drop_device_remove_and_limits(lora_setup):
    path, dirs, refs = lora_setup["opt0"]
    runner = build_runner(path)
    slots = slots_for(runner, infos_of(path, dirs), max_loras=2)
    n = len(PROMPTS)

    def check(rows):
        logits, tokens = decode([runner], [slots], rows, steps=1)
        assert_rows_match(logits, tokens, rows, {k: (v[0][:1], v[1][:1]) for k, v in refs.items()})

    check(["a1", "a2"] * (n // 2))
    assert slots.resident() == ("a1", "a2")
    check(["a3", "a1"] * (n // 2))  # a1 is least recently used but in this step: a2 leaves
    assert slots.resident() == ("a3", "a1")
    check([None, "a4", "a4", None, "a1", None])  # a3 leaves
    assert slots.resident() == ("a4", "a1")
    with pytest.raises(TooManyAdapters, match="3 LoRA adapters .* max_loras=2"):
        slots.activate(["a1", "a2", "a3", None, None, None])
    assert slots.resident() == ("a4", "a1")  # refused before anything moved
    with pytest.raises(AdapterError, match="'nope'"):
        slots.activate(["nope"] * n)
    check(["a2"] * n)

    full = slots.device_bytes()
    slots.drop_device()
    assert slots.device_bytes() == 0 and slots.resident() == () and slots.host_bytes() > 0
    check(["a3", None, "a4", "a3", None, "a4"])  # back from host memory
    assert slots.device_bytes() == full

    hooked = {id(m) for m in runner.module.modules() if m._forward_hooks}
    before = slots.host_bytes()
    a4_bytes = slots._host["a4"].nbytes
    slots.remove("a4")
    assert slots.host_bytes() == before - a4_bytes and "a4" not in slots.resident() + slots.adapters()
    with pytest.raises(AdapterError, match="'a4': is not added"):
        slots.activate(["a4"] * n)
    check(["a1", "a3"] * (n // 2))
    for aid in slots.adapters():
        slots.remove(aid)
    assert len(hooked) > 0 and not any(m._forward_hooks for m in runner.module.modules())
    assert slots.device_bytes() == 0 and slots.host_bytes() == 0


def test_device_stacks_follow_the_adapters_added(lora_setup):
    """Stacks hold min(max_loras, added) + 1 slots of the highest added rank; a bigger need reallocates
    them and the resident adapters come back as steps use them."""
    path, dirs, refs = lora_setup["opt0"]
    runner = build_runner(path)
    infos = infos_of(path, dirs)
    slots = LoraSlots(runner, max_loras=3, max_rank=16)
    rows = ["a1", None] * (len(PROMPTS) // 2)
    one_step = {k: (v[0][:1], v[1][:1]) for k, v in refs.items()}
    slots.add("a1", load_rank_adapter(infos["a1"], runner, pin=False))
    assert_rows_match(*decode([runner], [slots], rows, steps=1), rows, one_step)
    assert {tuple(t.A.shape[:2]) for t in slots._targets.values()} == {(2, 4)}
    small = slots.device_bytes()
    for aid in ("a2", "a3", "a4"):
        slots.add(aid, load_rank_adapter(infos[aid], runner, pin=False))
    rows = ["a3", "a1", "a4", None, "a3", "a1"]
    assert_rows_match(*decode([runner], [slots], rows, steps=1), rows, one_step)
    assert {tuple(t.A.shape[:2]) for t in slots._targets.values()} == {(4, 16)}
    assert slots.device_bytes() > small and slots.resident() == ("a3", "a1", "a4")


def test_add_refuses_ranks_over_max_and_duplicates(lora_setup):
    path, dirs, _ = lora_setup["llama0"]
    runner = build_runner(path)
    slots = LoraSlots(runner, max_loras=2, max_rank=8)
    info = check_adapter("a3", dirs["a3"], base_config(path))
    with pytest.raises(AdapterError, match=r"'a3': rank r=16 exceeds max_lora_rank=8"):
        slots.add("a3", load_rank_adapter(info, runner, pin=False))
    ra = load_rank_adapter(check_adapter("a1", dirs["a1"], base_config(path)), runner, pin=False)
    slots.add("a1", ra)
    with pytest.raises(AdapterError, match="already added"):
        slots.add("a1", ra)
    with slots.active(["a1"]):
        with pytest.raises(RuntimeError, match="in use"):
            slots.remove("a1")
        with pytest.raises(RuntimeError, match="already active"):
            slots.activate(["a1"])


# ---- TP=2: two gloo processes ---------------------------------------------------------------------

def _tp_rank(rank, world, init_file, cases, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, path, infos in cases:
            runner = build_runner(path, tp=world, rank=rank, tp_group=dist.group.WORLD)
            slots = slots_for(runner, infos)
            targets = slots._targets.values()
            assert any(t.row_parallel for t in targets) and any(not t.row_parallel for t in targets)
            logits, tokens = decode([runner], [slots], ROWS)
            if rank == 0:
                torch.save({"logits": logits, "tokens": tokens}, os.path.join(out_dir, f"{name}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,bases", [(2, ("opt0", "llama0")), (4, ("llama0",))], ids=["tp2", "tp4"])
def test_tp_column_and_row_parallel_slices_match_peft(lora_setup, tmp_path, world, bases):
    """TP over gloo: B split by output rows on column-parallel Linears, A by input columns on row-parallel
    ones with the partial sums all-reduced; Llama's k/v have fewer heads than q, and at TP=4 fewer than the
    ranks (each of its 2 KV heads kept by two ranks: B's rows of that head on both)."""
    cases = [(b, lora_setup[b][0], infos_of(lora_setup[b][0], lora_setup[b][1])) for b in bases]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_rank, args=(r, world, str(tmp_path / "init"), cases, str(tmp_path)),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert [p.exitcode for p in procs] == [0] * world
    for name, _, _ in cases:
        got = torch.load(str(tmp_path / f"{name}.pt"))
        assert_rows_match(got["logits"], got["tokens"], ROWS, lora_setup[name][2])


def test_adapters_take_the_base_dtype(lora_setup):
    """A float32 adapter on a bfloat16 base: host copies and device stacks in bfloat16, rows close to PEFT
    on the same bfloat16 base (the scaling is folded into B in float32 before the cast)."""
    path, dirs, _ = lora_setup["llama0"]
    runner = make_runner(zoo.load_causal_lm(path, dtype="bfloat16"), ModelConfig("m", zoo.load_causal_lm,
                         {"path": path, "dtype": "bfloat16"}), build_runner(path).ctx)
    slots = slots_for(runner, infos_of(path, {"a1": dirs["a1"]}))
    assert {t.dtype for ab in slots._host["a1"].weights.values() for t in ab} == {torch.bfloat16}
    rows = ["a1", None] * (len(PROMPTS) // 2)
    logits, _ = decode([runner], [slots], rows, steps=1)
    assert {t.A.dtype for t in slots._targets.values()} == {torch.bfloat16}
    for aid in ("a1", None):
        from peft import PeftModel
        model = zoo.load_causal_lm(path, dtype="bfloat16")
        model = PeftModel.from_pretrained(model, dirs["a1"]).eval() if aid else model
        for i, row in enumerate(rows):
            if row == aid:
                ref = reference(model, PROMPTS[i], steps=1)[0]
                assert (logits[0, i] - ref).abs().max() < 0.05 * ref.abs().max(), (i, aid)
