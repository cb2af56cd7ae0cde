"""Hub ids (``computron/hub.py``) resolved offline from a Hugging Face cache these tests write in
huggingface_hub's layout (``computron.testing.hub_cache``): ids, revisions and GGUF files of a repository, a
local path winning over an id, every error naming the id and the cache, and the places an id goes (the
loaders, the preflight, the server's model entries and command line)."""
import filecmp
import os
import shutil
import subprocess
import sys

import pytest

from computron import EngineConfig, ModelConfig, hub, loading, preflight
from computron.errors import HubError
from computron.preflight import PreflightError
from computron.testing import hub_cache

REPO, GGUF_REPO = "demo-org/tiny-llama", "demo-org/tiny-llama-GGUF"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny Llama checkpoints with a tokenizer (seeds 0 and 1) and a tiny Llama GGUF file, each in a
    directory of its own: the files the cache's repositories hold."""
    from helpers import write_tiny_llama_gguf

    from computron.testing import tokenizer_zoo as tz
    root = tmp_path_factory.mktemp("hub-sources")
    tok = tz.train_bpe(vocab_size=512)
    out = {f"seed{s}": tz.save_checkpoint_with_tokenizer("llama-tiny", str(root / f"seed{s}"), seed=s, tokenizer=tok)
           for s in (0, 1)}
    (root / "gguf").mkdir()
    write_tiny_llama_gguf(root / "gguf" / "tiny.gguf")
    (root / "gguf" / "README.md").write_text("a GGUF repository\n")
    out["gguf"] = str(root / "gguf")
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch, sources):
    """An offline Hugging Face cache: REPO at main (seed 0) and at tag v1 (seed 1), GGUF_REPO at main."""
    root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    snaps = {"main": hub_cache.write_repo(str(root), REPO, sources["seed0"]),
             "v1": hub_cache.write_repo(str(root), REPO, sources["seed1"], refs=("v1",)),
             "gguf": hub_cache.write_repo(str(root), GGUF_REPO, sources["gguf"])}
    return str(root), snaps


def one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_parse_ids_and_what_is_not_one():
    assert hub.parse("org/name") == hub.HubRef("org/name")
    assert hub.parse("org/name@v1.0") == hub.HubRef("org/name", "v1.0")
    assert hub.parse("org/na.me-2@refs/pr/3") == hub.HubRef("org/na.me-2", "refs/pr/3")
    assert hub.parse("org/name:m.Q4_1.gguf") == hub.HubRef("org/name", None, "m.Q4_1.gguf")
    assert hub.parse("org/name@abc:sub/m.GGUF") == hub.HubRef("org/name", "abc", "sub/m.GGUF")
    assert str(hub.parse("org/name@abc:sub/m.gguf")) == "org/name@abc:sub/m.gguf"
    assert hub.parse("org/name@v1").model_id == "name" and hub.parse("org/x:sub/m.Q4.gguf").model_id == "m.Q4"
    for text in ("name", "/abs/org/name", "./org/name", "~/org/name", "a/b/c", "org/name:weights.bin", "org/..",
                 "org/name@", "org/name@.x", "org//name", "org/name:", None, 3):
        assert hub.parse(text) is None, text


def test_the_cache_is_in_huggingface_hubs_layout(cache):
    """huggingface_hub's own scan reads the written cache without a warning: its repos, commits and refs."""
    from huggingface_hub import scan_cache_dir
    root, snaps = cache
    info = scan_cache_dir(root)
    assert info.warnings == []
    found = {r.repo_id: {rev.commit_hash: set(rev.refs) for rev in r.revisions} for r in info.repos}
    assert found == {REPO: {os.path.basename(snaps["main"]): {"main"}, os.path.basename(snaps["v1"]): {"v1"}},
                     GGUF_REPO: {os.path.basename(snaps["gguf"]): {"main"}}}
    assert os.path.islink(os.path.join(snaps["main"], "config.json"))
    assert os.readlink(os.path.join(snaps["main"], "config.json")).startswith("../../blobs/")


def test_ids_resolve_to_the_cached_snapshots_and_files(cache, sources):
    root, snaps = cache
    assert hub.cache_dir() == root
    assert hub.resolve(REPO) == snaps["main"]
    assert hub.resolve(f"{REPO}@v1") == snaps["v1"]
    assert hub.resolve(f"{REPO}@{os.path.basename(snaps['v1'])}") == snaps["v1"]  # a commit hash
    gguf_file = hub.resolve(f"{GGUF_REPO}:tiny.gguf")
    assert gguf_file == os.path.join(snaps["gguf"], "tiny.gguf")
    assert filecmp.cmp(gguf_file, os.path.join(sources["gguf"], "tiny.gguf"), shallow=False)
    assert filecmp.cmp(os.path.join(snaps["v1"], "model.safetensors"),
                       os.path.join(sources["seed1"], "model.safetensors"), shallow=False)


def test_a_local_path_wins_over_an_id(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs(REPO)  # ./demo-org/tiny-llama exists here: it is served, not the hub's
    assert not hub.is_hub_id(REPO) and hub.resolve(REPO) == REPO
    os.makedirs("ckpt")  # ckpt/missing: a local path (its first directory exists), left to the missing-path checks
    assert not hub.is_hub_id("ckpt/missing") and hub.resolve("ckpt/missing") == "ckpt/missing"
    assert hub.resolve("/no/such/dir") == "/no/such/dir" and hub.resolve(None) is None
    with pytest.raises(FileNotFoundError, match=r"checkpoint directory 'ckpt/missing' does not exist"):
        loading.load_causal_lm("ckpt/missing")


def test_what_is_not_in_the_cache_is_one_line_naming_the_id_and_the_cache(cache, monkeypatch, tmp_path):
    root, _ = cache
    hint = "HF_HUB_OFFLINE is set: nothing is downloaded; fetch it into that cache where the network is"
    with pytest.raises(HubError) as exc:
        hub.resolve("demo-org/missing")
    assert one_line(exc) == (f"demo-org/missing: no such local path, and demo-org/missing is not in the Hugging "
                             f"Face cache {root} ({hint} (hf download demo-org/missing), or set HF_HUB_CACHE or "
                             "HF_HOME to the cache that holds it)")
    with pytest.raises(HubError) as exc:
        hub.resolve(f"{REPO}@v2")
    assert one_line(exc).startswith(f"{REPO}@v2: no such local path, and {REPO} at revision v2 is not in the "
                                    f"Hugging Face cache {root} ({hint} (hf download {REPO} --revision v2)")
    with pytest.raises(HubError) as exc:
        hub.resolve(f"{GGUF_REPO}:other.gguf")
    assert one_line(exc).startswith(f"{GGUF_REPO}:other.gguf: no such local path, and the file 'other.gguf' of "
                                    f"{GGUF_REPO} is not in the Hugging Face cache {root} (")
    with pytest.raises(HubError) as exc:  # a GGUF repository named without its file
        hub.resolve(GGUF_REPO)
    assert one_line(exc).endswith(f"has no config.json but GGUF files: name one, e.g. {GGUF_REPO}:tiny.gguf "
                                  "(it holds tiny.gguf)")
    monkeypatch.delenv("HF_HUB_CACHE")  # HF_HOME names the cache's parent
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(HubError, match=f"is not in the Hugging Face cache {tmp_path / 'home' / 'hub'} "):
        hub.resolve(REPO)
    shutil.copytree(root, tmp_path / "home" / "hub", symlinks=True)
    assert hub.resolve(REPO) == os.path.join(tmp_path / "home" / "hub", os.path.relpath(cache[1]["main"], root))


def test_without_a_network_the_cache_serves(cache, tmp_path):
    """Not offline, but the hub cannot be reached (its endpoint refuses connections): what the cache holds
    resolves, what it lacks fails naming the id, the cache and why."""
    root, snaps = cache
    code = ("from computron import hub\nfrom computron.errors import HubError\n"
            f"print(hub.resolve({REPO!r}))\nprint(hub.resolve({GGUF_REPO + ':tiny.gguf'!r}))\n"
            "try:\n    hub.resolve('demo-org/missing')\nexcept HubError as exc:\n    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(hub.__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == [snaps["main"], os.path.join(snaps["gguf"], "tiny.gguf")], out.stdout
    assert lines[2].startswith(f"demo-org/missing: no such local path, and demo-org/missing is not in the Hugging "
                               f"Face cache {root} (the hub could not be reached: "), lines[2]


def test_the_loaders_take_an_id(cache):
    import torch
    root, snaps = cache
    ids = torch.tensor([[1, 5, 9, 30, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loading.load_causal_lm(f"{REPO}@v1")(ids).logits,
                           loading.load_causal_lm(snaps["v1"])(ids).logits)
    with pytest.raises(HubError, match=f"^demo-org/missing: no such local path, .* cache {root} "):
        loading.load_causal_lm("demo-org/missing")


def test_preflight_resolves_once_and_names_the_local_paths(cache, monkeypatch):
    root, snaps = cache
    calls = []
    fetch = hub.fetch
    monkeypatch.setattr(hub, "fetch", lambda ref: calls.append(str(ref)) or fetch(ref))
    mc = ModelConfig("tiny", loading.load_causal_lm, {"path": f"{REPO}@v1", "dtype": "float32"},
                     checkpoint=f"{REPO}@v1")
    preflight.check(EngineConfig(device="cpu"), [mc], 2, 2)
    assert mc.checkpoint == snaps["v1"] and mc.model_kwargs == {"path": snaps["v1"], "dtype": "float32"}
    assert calls == [f"{REPO}@v1"] and loading.checkpoint_of(mc) == (snaps["v1"], "float32")
    mc = ModelConfig("m", loading.load_causal_lm, {"path": "demo-org/missing"})
    with pytest.raises(PreflightError) as exc:
        preflight.check(EngineConfig(device="cpu"), [mc], 1, 1)
    assert one_line(exc).startswith(f"model 'm': demo-org/missing: no such local path, and demo-org/missing is not "
                                    f"in the Hugging Face cache {root} (")


def test_preflight_converts_a_gguf_file_of_a_repository(cache, monkeypatch, tmp_path):
    """``org/name:FILE.gguf`` becomes the cached file, which the GGUF path then converts as a local file."""
    from computron.storage import gguf
    _, snaps = cache
    monkeypatch.setenv("COMPUTRON_CACHE_DIR", str(tmp_path / "computron-cache"))
    mc = ModelConfig("g", loading.load_causal_lm, {"path": f"{GGUF_REPO}:tiny.gguf"})
    preflight.check(EngineConfig(device="cpu"), [mc], 1, 2)
    converted = mc.model_kwargs["path"]
    assert converted == gguf.cache_dir(os.path.join(snaps["gguf"], "tiny.gguf")) and os.path.isdir(converted)


def test_server_entries_yaml_and_command_line(cache, capsys, tmp_path, monkeypatch):
    from computron.server.cli import _parser, build_config, main
    from computron.server.config import ConfigError, model_entries_from_paths, parse_model
    from computron.server.model_kind import ModelKind
    root, snaps = cache
    monkeypatch.setenv("COMPUTRON_CACHE_DIR", str(tmp_path / "computron-cache"))
    assert model_entries_from_paths([REPO, f"{REPO}@v1", f"{GGUF_REPO}:tiny.gguf", f"x={REPO}"]) == [
        {"id": "tiny-llama", "path": REPO}, {"id": "tiny-llama", "path": f"{REPO}@v1"},
        {"id": "tiny", "path": f"{GGUF_REPO}:tiny.gguf"}, {"id": "x", "path": REPO}]
    entry = parse_model({"id": "llama", "path": f"{REPO}@v1"}, "models[0]")
    assert entry.path == snaps["v1"] and entry.hub == f"{REPO}@v1" and entry.kind == ModelKind.GENERATION
    with pytest.raises(ConfigError, match=r"models\[1\]\.hub: unknown field"):
        parse_model({"id": "c", "path": REPO, "hub": REPO}, "models[1]")
    cfg = build_config(_parser().parse_args(["serve", f"llama={REPO}", f"{REPO}@v1"]))
    assert [(m.id, m.path, m.hub) for m in cfg.models] == [("llama", snaps["main"], REPO),
                                                           ("tiny-llama", snaps["v1"], f"{REPO}@v1")]
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(f"models:\n  - id: a\n    path: {REPO}\n  - id: g\n    path: {GGUF_REPO}:tiny.gguf\n")
    cfg = build_config(_parser().parse_args(["serve", "--config", str(yaml_file)]))
    assert [(m.id, m.hub) for m in cfg.models] == [("a", REPO), ("g", f"{GGUF_REPO}:tiny.gguf")]
    assert cfg.models[0].path == snaps["main"] and cfg.models[1].gguf == os.path.join(snaps["gguf"], "tiny.gguf")
    with pytest.raises(ConfigError) as exc:
        parse_model({"id": "m", "path": "demo-org/missing"}, "models[2]")
    assert one_line(exc).startswith(f"models[2].path: demo-org/missing: no such local path, and demo-org/missing "
                                    f"is not in the Hugging Face cache {root} (")
    assert main(["serve", "m=demo-org/missing", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"computron serve: error: models[0].path: demo-org/missing: no such local path, and "
                          f"demo-org/missing is not in the Hugging Face cache {root} (HF_HUB_OFFLINE is set"), err


def test_downloads_show_huggingface_hubs_progress_bars(cache, monkeypatch):
    """Online, a fetch runs with huggingface_hub's progress bars on even after transformers turned them off in
    this process, and leaves them as they were; HF_HUB_DISABLE_PROGRESS_BARS=1 and offline reads keep them off."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    _, snaps = cache
    seen = []

    def download(ref, cache_dir, local_only):
        seen.append((local_only, are_progress_bars_disabled()))
        return snaps["main"]
    monkeypatch.setattr(hub, "_download_snapshot", download)
    before = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        hub.resolve(REPO)  # offline (the fixture's HF_HUB_OFFLINE=1): nothing to show
        monkeypatch.delenv("HF_HUB_OFFLINE")
        assert hub.resolve(REPO) == snaps["main"] and are_progress_bars_disabled()
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        hub.resolve(REPO)
    finally:
        (disable_progress_bars if before else enable_progress_bars)()
    assert seen == [(True, True), (False, False), (False, True)]


def test_online_a_snapshot_fetches_safetensors_and_falls_back_to_bin_weights(cache, monkeypatch, tmp_path):
    """What is asked of huggingface_hub online: no pickled .bin weights, ONNX, GGUF, ... beside safetensors;
    the .bin weights in a second call only when the snapshot has no safetensors file."""
    import huggingface_hub
    root, snaps = cache
    monkeypatch.delenv("HF_HUB_OFFLINE")
    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    calls = []

    def snapshot_download(repo_id, revision, cache_dir, local_files_only, ignore_patterns):
        calls.append((repo_id, revision, cache_dir, local_files_only, ignore_patterns))
        return snaps["main"] if repo_id == REPO else str(bin_only)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert hub.resolve(f"{REPO}@v1") == snaps["main"]
    without_bin = list(hub.NOT_FETCHED + hub.PICKLED_WEIGHTS)
    assert calls == [(REPO, "v1", root, False, without_bin)] and "*.bin" in without_bin and "*.gguf" in without_bin
    calls.clear()
    assert hub.resolve("demo-org/old") == str(bin_only)
    assert calls == [("demo-org/old", None, root, False, without_bin),
                     ("demo-org/old", None, root, False, list(hub.NOT_FETCHED))]
