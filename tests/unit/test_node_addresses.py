"""Several nodes: the preflight check of this host's name against loopback (a policy on resolved addresses and
the environment, milliseconds; no network)."""
import pytest

from computron import EngineConfig, preflight
from computron.preflight import PreflightError, loopback_host_problem


@pytest.mark.parametrize("addresses", [["127.0.1.1"], ["127.0.0.1", "10.0.0.5"], ["::1"]])
def test_a_host_name_resolving_to_loopback_on_several_nodes_is_refused_naming_the_fix(addresses):
    problem = loopback_host_problem(2, "node-a", addresses, {})
    assert problem.startswith(f"2 nodes, but this host's name 'node-a' resolves to the loopback address "
                              f"{addresses[0]} ")
    assert "Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME with GPUs)" in problem


@pytest.mark.parametrize("n_nodes, addresses, env", [
    (1, ["127.0.1.1"], {}),  # one node: loopback is all it needs
    (2, ["10.0.0.5", "127.0.1.1"], {}),  # resolves first to a reachable address
    (2, ["127.0.1.1"], {"GLOO_SOCKET_IFNAME": "eth0"}),  # the interface is named
    (2, ["127.0.1.1"], {"NCCL_SOCKET_IFNAME": "ib0"}),
    (2, [], {}),  # does not resolve: gloo says so itself
])
def test_what_is_not_a_loopback_problem(n_nodes, addresses, env):
    assert loopback_host_problem(n_nodes, "node-a", addresses, env) is None


def test_preflight_refuses_several_nodes_on_a_loopback_host_name(monkeypatch):
    monkeypatch.setattr(preflight, "_resolve", lambda host: ["127.0.1.1"])
    for var in preflight.SOCKET_IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PreflightError, match="resolves to the loopback address 127.0.1.1"):
        preflight.check(EngineConfig(), [], 2, 1, n_nodes=2, node_rank=1, attach=False)
    preflight.check(EngineConfig(), [], 2, 1, n_nodes=1, attach=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    preflight.check(EngineConfig(), [], 2, 1, n_nodes=2, node_rank=1, attach=False)
    # under a launcher: its world over this node's part
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(PreflightError, match="2 nodes, but"):
        preflight.check(EngineConfig(), [], 2, 2, attach=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    preflight.check(EngineConfig(), [], 2, 2, attach=True)


def test_a_rendezvous_nobody_answers_fails_naming_the_address_it_waited_for():
    import socket

    from computron.runtime.process_setup import join_rendezvous
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match=rf"^rank 1 could not join the process group of the rendezvous at "
                                           rf"127\.0\.0\.1:{port} within 1s \(EngineConfig\.rendezvous_timeout_s\)"):
        join_rendezvous("127.0.0.1", port, 1, 2, timeout_s=1.0)
