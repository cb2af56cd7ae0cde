"""Which workers `start_fork_server` starts early: only those the launch would fork from the fork server
(its start with a process is covered by tests/server: `computron serve` and a config error after it)."""
import psutil

from computron import EngineConfig
from computron.runtime.worker_start import start_fork_server, worker_context


def test_cpu_workers_fork_from_the_server_and_cuda_or_spawn_ones_start_nothing_early():
    assert worker_context(EngineConfig(device="cpu")).get_start_method() == "forkserver"
    assert worker_context(EngineConfig(device="cpu", start_method="spawn")).get_start_method() == "spawn"
    assert worker_context(EngineConfig(device="cuda")).get_start_method() == "spawn"
    assert worker_context(EngineConfig(start_method="auto"), device="cuda").get_start_method() == "spawn"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for config in (EngineConfig(device="cpu", start_method="spawn"), EngineConfig(device="cuda")):
        assert start_fork_server(config) is None, config
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
