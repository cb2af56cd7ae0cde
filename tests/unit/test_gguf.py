"""GGUF files as checkpoints (``computron/storage/gguf.py``) without converting a real model: every bad input
fails as one line naming the file, the cache is reused, atomic and locked, and the preflight, the server's
model entries and a model repository take a ``.gguf`` where a checkpoint directory goes."""
import json
import logging
import os
import threading

import pytest

from computron import EngineConfig, ModelConfig, loading, preflight
from computron.errors import GGUFError
from computron.preflight import PreflightError
from computron.storage import gguf

np = pytest.importorskip("numpy")


def write_gguf(path, arch="llama", qtype=None) -> str:
    """A tiny GGUF file: one float32 tensor, and one of type ``qtype`` when given."""
    g = pytest.importorskip("gguf")
    w = g.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    if qtype is not None:
        w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 40), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("COMPUTRON_CACHE_DIR", str(root))
    return root / "gguf"


@pytest.fixture
def fake_convert(monkeypatch):
    """``gguf._convert`` replaced by one that writes a random llama-tiny checkpoint (and a tokenizer file) in
    a blink; ``calls`` counts the conversions."""
    from computron import zoo
    calls = []

    def convert(info, dtype, out, target):
        calls.append((info.path, dtype, out, target))
        zoo.save_random_causal_lm("llama-tiny", out, seed=0)
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({}, f)
    monkeypatch.setattr(gguf, "_convert", convert)
    return calls


def one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# ---- bad input: one line naming the file ---------------------------------------------------------

def test_not_a_gguf_file(tmp_path, cache):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(GGUFError) as exc:
        gguf.convert(path)
    assert one_line(exc) == f"{path}: not a GGUF file (it begins with b'PK\\x03\\x04', not the magic b'GGUF')"
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty\.gguf: not a GGUF file \(an empty file"):
        gguf.convert(tmp_path / "empty.gguf")
    with pytest.raises(GGUFError, match=r"missing\.gguf: no such GGUF file$"):
        gguf.convert(tmp_path / "missing.gguf")
    assert not cache.exists()


@pytest.mark.parametrize("keep", [30, -100])
def test_truncated_file(tmp_path, cache, keep):
    data = open(write_gguf(tmp_path / "full.gguf"), "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(GGUFError) as exc:
        gguf.convert(path)
    size = len(data[:keep])
    assert one_line(exc) in (f"{path}: truncated or corrupt GGUF file ({size} bytes): its header ends early",
                             f"{path}: truncated GGUF file: its tensors end at byte {len(data)}, the file has {size}")
    assert not cache.exists() or not os.listdir(cache)


def test_architecture_transformers_cannot_read(tmp_path, cache):
    path = write_gguf(tmp_path / "odd.gguf", arch="nonesuch")
    with pytest.raises(GGUFError) as exc:
        gguf.convert(path)
    assert one_line(exc).startswith(f"{path}: GGUF architecture 'nonesuch' is not one transformers ")
    assert "can read (it reads: " in str(exc.value) and "llama" in str(exc.value)


def test_block_type_not_served(tmp_path, cache):
    import gguf as g
    path = write_gguf(tmp_path / "q81.gguf", qtype=g.GGMLQuantizationType.Q8_1)
    with pytest.raises(GGUFError) as exc:
        gguf.convert(path)
    assert one_line(exc) == (f"{path}: tensor 'blk.0.attn_q.weight' is stored as Q8_1, a block type Computron does "
                             "not serve (it serves F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)")


def test_unwritable_cache_directory(tmp_path, monkeypatch, fake_convert):
    path = write_gguf(tmp_path / "tiny.gguf")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("COMPUTRON_CACHE_DIR", str(blocker))
    with pytest.raises(GGUFError) as exc:
        gguf.convert(path)
    assert one_line(exc) == (f"{path}: cannot write its converted checkpoint to the cache directory "
                             f"{blocker}/gguf (Not a directory); set COMPUTRON_CACHE_DIR to a writable directory")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        (ro / "gguf").mkdir(parents=True)
        os.chmod(ro / "gguf", 0o500)
        monkeypatch.setenv("COMPUTRON_CACHE_DIR", str(ro))
        with pytest.raises(GGUFError, match="Permission denied"):
            gguf.convert(path)
    assert not fake_convert


# ---- the cache ----------------------------------------------------------------------------------

def test_cache_reused_keyed_and_atomic(tmp_path, cache, fake_convert, caplog):
    path = write_gguf(tmp_path / "tiny.gguf")
    with caplog.at_level(logging.INFO, logger="computron.gguf"):
        first = gguf.convert(path)
        assert gguf.convert(path) == first  # the second call converts nothing
    assert len(fake_convert) == 1 and fake_convert[0][1] == "float32"
    assert os.path.dirname(first) == str(cache) and os.path.basename(first).startswith("tiny-float32-")
    assert os.path.isfile(os.path.join(first, "config.json"))
    assert any("(cached)" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(first), os.path.basename(first) + ".lock"])
    # another dtype, or the file changed in place: converted again, into another directory
    assert gguf.convert(path, "bfloat16") != first and fake_convert[-1][1] == "bfloat16"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gguf.convert(path) not in (first, None) and len(fake_convert) == 3


def test_killed_conversion_leaves_nothing_and_is_cleaned_up(tmp_path, cache, fake_convert, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf")
    target = gguf.cache_dir(path)
    cache.mkdir(parents=True)
    stale = cache / f".{os.path.basename(target)}.tmp-killed"  # what a SIGKILLed conversion leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")

    def dies(info, dtype, out, target):
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{")
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf, "_convert", dies)
    with pytest.raises(KeyboardInterrupt):
        gguf.convert(path)
    assert not os.path.exists(target) and not stale.exists()
    assert [f for f in os.listdir(cache) if not f.endswith(".lock")] == []


def test_a_second_converter_waits_for_the_first(tmp_path, cache, monkeypatch):
    """Two converters of one file (threads here; the lock is flock's, per open file, so processes alike):
    the second waits on the lock, then finds the first one's directory and converts nothing."""
    path = write_gguf(tmp_path / "tiny.gguf")
    started, waiting, release, calls = threading.Event(), threading.Event(), threading.Event(), []

    def slow(info, dtype, out, target):
        calls.append(out)
        started.set()  # the first converter holds the lock now
        assert release.wait(30)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
    monkeypatch.setattr(gguf, "_convert", slow)

    class Waiting(logging.Handler):
        def emit(self, record):
            if "another process is converting it" in record.getMessage():
                waiting.set()
    handler = Waiting()
    logger = logging.getLogger("computron.gguf")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    results = []
    try:
        first = threading.Thread(target=lambda: results.append(gguf.convert(path)))
        first.start()
        second = threading.Thread(target=lambda: results.append(gguf.convert(path)))
        assert started.wait(30)
        second.start()
        assert waiting.wait(30)
        release.set()
        first.join(30)
        second.join(30)
    finally:
        release.set()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1] == gguf.cache_dir(path)


# ---- a real conversion (a tiny Llama) --------------------------------------------------------------

def test_tiny_llama_converted_as_transformers_reads_it(tmp_path, cache):
    """What the cache holds is the file's metadata as transformers reads it (config, tokenizer with its chat
    template, generation config; no weights: those stay in the file), and the loader of that directory gives
    the logits transformers gives for the file; bfloat16 is served as bfloat16."""
    import torch
    from helpers import write_tiny_llama_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = gguf.convert(path)
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja",
            "gguf_source.json"} <= set(os.listdir(out))
    assert not [f for f in os.listdir(out) if f.endswith(".safetensors")]
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf").eval()
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loading.load_causal_lm(out)(ids).logits, direct(ids).logits)
        assert torch.equal(loading.load_causal_lm(path)(ids).logits, direct(ids).logits)  # the loader, called alone
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "ABC"}], add_generation_prompt=True,
                                   tokenize=False) == "<|im_start|>user\nABC<|im_end|>\n<|im_start|>assistant\n"
    assert json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == 2
    bf16 = gguf.convert(path, "bfloat16")
    assert loading.checkpoint_dtype(bf16) == "bfloat16" and loading.checkpoint_dtype(out) == "float32"


def test_an_architecture_whose_tensors_transformers_reshapes_is_converted_to_float(tmp_path, cache, monkeypatch,
                                                                                  caplog):
    """A file whose blocks cannot be served as they are (``gguf_native.check_architecture`` refuses its
    architecture: Gemma 2/3, GPT-2, Bloom... need transformers' reshaping; simulated here on a tiny Llama) is
    still served: converted once into a float checkpoint, as transformers reads it, with a WARNING saying why."""
    import torch
    from helpers import write_tiny_llama_gguf
    from transformers import AutoModelForCausalLM

    from computron.storage import gguf_native

    def refuse(path, arch):
        raise GGUFError(f"{path}: GGUF architecture {arch!r}: its tensors need transformers' reshaping")
    monkeypatch.setattr(gguf_native, "check_architecture", refuse)
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with caplog.at_level(logging.WARNING, logger="computron.gguf"):
        out = gguf.convert(path)
    assert "converting it to a float32 checkpoint instead" in caplog.text
    assert gguf_native.source_of(out) is None and [f for f in os.listdir(out) if f.endswith(".safetensors")]
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf").eval()
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loading.load_causal_lm(out)(ids).logits, direct(ids).logits)


def test_conversion_inside_a_process_group_of_rank_other_than_0(tmp_path, cache, monkeypatch):
    """The master of a running engine is rank tp*pp of its process group (a model added while serving has its
    metadata written there): the metadata directory is written all the same."""
    import transformers.distributed.mixin as mixin
    from helpers import write_tiny_llama_gguf
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 2)
    out = gguf.convert(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    assert {"config.json", "tokenizer.json", "gguf_source.json"} <= set(os.listdir(out))


# ---- where a checkpoint goes --------------------------------------------------------------------

def test_preflight_converts_and_names_the_directory(tmp_path, cache, fake_convert):
    path = write_gguf(tmp_path / "tiny.gguf")
    mc = ModelConfig("tiny", loading.load_causal_lm, {"path": path, "dtype": "bfloat16"}, checkpoint=path)
    preflight.check(EngineConfig(device="cpu"), [mc], 1, 2)
    target = gguf.cache_dir(path, "bfloat16")
    assert mc.checkpoint == target and mc.model_kwargs == {"path": target, "dtype": "bfloat16"}
    assert len(fake_convert) == 1
    assert loading.checkpoint_of(mc) == (target, "bfloat16")


def test_preflight_errors_name_the_model_and_the_file(tmp_path, cache):
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    mc = ModelConfig("m", loading.load_causal_lm, {"path": str(bad)})
    with pytest.raises(PreflightError) as exc:
        preflight.check(EngineConfig(device="cpu"), [mc], 1, 1)
    assert one_line(exc) == f"model 'm': {bad}: not a GGUF file (it begins with b'hell', not the magic b'GGUF')"
    mc = ModelConfig("m", loading.load_causal_lm, {"path": str(bad), "dtype": "int8"})
    with pytest.raises(PreflightError, match=r"model 'm': model_kwargs\['dtype'\]='int8': must be one of"):
        preflight.check(EngineConfig(device="cpu"), [mc], 1, 1)


def test_server_entry_and_repository(tmp_path, cache, fake_convert):
    from computron.server.config import ConfigError, model_entries_from_paths, parse_model
    from computron.server.model_kind import ModelKind
    from computron.server.repository import ModelRepository
    path = write_gguf(tmp_path / "SmolThing.Q4.gguf")
    assert model_entries_from_paths([path, f"x={path}"]) == [{"id": "SmolThing.Q4", "path": path},
                                                             {"id": "x", "path": path}]
    entry = parse_model({"id": "smol", "path": path, "dtype": "float16"}, "models[0]")
    assert entry.gguf == path and entry.path == gguf.cache_dir(path, "float16") and entry.kind == ModelKind.GENERATION
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    with pytest.raises(ConfigError) as exc:
        parse_model({"id": "b", "path": str(bad)}, "models[1]")
    assert one_line(exc) == f"models[1].path: {bad}: not a GGUF file (it begins with b'hell', not the magic b'GGUF')"
    with pytest.raises(ConfigError, match=r"models\[2\]\.gguf: unknown field"):
        parse_model({"id": "c", "path": path, "gguf": path}, "models[2]")
    repo = tmp_path / "repo"
    for name, files in (("one", ["m.gguf"]), ("two", ["a.gguf", "b.gguf"]), ("none", ["notes.txt"])):
        (repo / name).mkdir(parents=True)
        for f in files:
            (repo / name / f).write_bytes(open(path, "rb").read())
    r = ModelRepository(str(repo))
    assert r.scan() == {"one": str(repo / "one" / "m.gguf")}
    assert r.holds(str(repo / "one" / "m.gguf")) and r.holds(str(repo / "one"))
    assert not r.holds(gguf.cache_dir(path)) and not r.holds(str(tmp_path / "x.gguf"))
