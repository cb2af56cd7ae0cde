"""Two "nodes" on this machine: two Linux network namespaces joined by a bridge in a third (root, iproute2 and
util-linux's ``unshare``; no sshd). Each node has its own address, its own host name (every process is started
under ``unshare --uts`` with ``hostname nodeN``) and an /etc/hosts naming both (``ip netns exec`` bind-mounts
/etc/netns/NS/hosts over /etc/hosts). No route leaves the namespaces: the bridge has no uplink.

Names carry a per-run prefix (``cm`` + 4 hex digits) and the subnet is 10.200.X.0/24 with X per run, so that two
runs cannot collide. ``TwoNodes.destroy`` kills every process still in the node namespaces (``ip netns pids``:
only processes this run started live there), deletes the namespaces (their veths and the bridge go with them)
and /etc/netns/NS, and returns what it found left over: nothing, when all went well.

Also a script: ``python tests/multinode/nodes.py up`` prints the shell commands of the same set-up (the
two-node recipe of docs/cluster.md), ``down PREFIX`` those that remove it.
"""
from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

NETNS_ETC = "/etc/netns"


def missing() -> Optional[str]:
    """Why two namespaced nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    return None


@dataclass
class Node:
    index: int
    """1 or 2."""
    ns: str
    """Its network namespace."""
    addr: str
    hostname: str
    veth: str
    """Its end of the link to the bridge (inside ``ns``)."""
    port: str
    """The bridge's end (inside the bridge namespace)."""

    def argv(self, cmd: Sequence[str]) -> List[str]:
        """``cmd`` as run on this node: in its namespace, under its own host name."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh", *cmd]


def setup_commands(prefix: str, subnet: int) -> List[List[str]]:
    """The ``ip`` commands that make the two nodes and the bridge (each an argv)."""
    br = f"{prefix}br"
    cmds = [["ip", "netns", "add", br], ["ip", "-n", br, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", br, "link", "set", "br0", "up"]]
    for n in nodes_of(prefix, subnet):
        cmds += [["ip", "netns", "add", n.ns],
                 ["ip", "link", "add", n.veth, "netns", n.ns, "type", "veth", "peer", "name", n.port, "netns", br],
                 ["ip", "-n", br, "link", "set", n.port, "master", "br0", "up"],
                 ["ip", "-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.veth],
                 ["ip", "-n", n.ns, "link", "set", n.veth, "up"], ["ip", "-n", n.ns, "link", "set", "lo", "up"],
                 # a default route over the bridge (where nothing answers): programs that find their own
                 # address by "which source would reach the internet" (Ray, gloo) find the node's address
                 ["ip", "-n", n.ns, "route", "add", "default", "dev", n.veth]]
    return cmds


def nodes_of(prefix: str, subnet: int) -> List[Node]:
    return [Node(i, f"{prefix}n{i}", f"10.200.{subnet}.{i}", f"node{i}", f"{prefix}v{i}", f"{prefix}p{i}")
            for i in (1, 2)]


def hosts_file(nodes: Sequence[Node]) -> str:
    return "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.hostname}\n" for n in nodes)


class TwoNodes:
    """Two namespaced nodes (see the module docstring); ``create`` then, always, ``destroy``."""

    def __init__(self, prefix: Optional[str] = None, subnet: Optional[int] = None):
        self.prefix = prefix or f"cm{secrets.token_hex(2)}"
        self.subnet = subnet if subnet is not None else 1 + secrets.randbelow(254)
        self.nodes = nodes_of(self.prefix, self.subnet)
        self.bridge_ns = f"{self.prefix}br"
        self.procs: List[subprocess.Popen] = []

    def create(self) -> "TwoNodes":
        for cmd in setup_commands(self.prefix, self.subnet):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)
        for n in self.nodes:
            os.makedirs(os.path.join(NETNS_ETC, n.ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, n.ns, "hosts"), "w") as f:
                f.write(hosts_file(self.nodes))
        return self

    def popen(self, node: Node, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on ``node`` (in its own process group, so that the group can be signalled)."""
        p = subprocess.Popen(node.argv(cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, node: Node, cmd: Sequence[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(node.argv(cmd), capture_output=True, text=True, timeout=timeout, **kw)

    def cut(self, node: Node) -> None:
        """A silent partition: the node's port leaves the bridge (its link stays up: nothing tells it)."""
        subprocess.run(["ip", "-n", self.bridge_ns, "link", "set", node.port, "nomaster"], check=True, timeout=30)

    def join(self, node: Node) -> None:
        subprocess.run(["ip", "-n", self.bridge_ns, "link", "set", node.port, "master", "br0"], check=True,
                       timeout=30)

    def pids(self, node: Node) -> List[int]:
        out = subprocess.run(["ip", "netns", "pids", node.ns], capture_output=True, text=True, timeout=30).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, node: Node, sig: int = signal.SIGKILL) -> List[int]:
        """Signal every process in the node's namespace (all started by this run); returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def leftovers(self) -> Dict[str, List[str]]:
        """What of this run is still there: namespaces, links named with the prefix, /etc/netns dirs, processes."""
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
        out = {"namespaces": [ln.split()[0] for ln in netns.splitlines() if ln.startswith(self.prefix)],
               "links": [ln.split(":")[1].strip() for ln in links.splitlines() if self.prefix in ln],
               "etc": [d for d in (os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else [])
                       if d.startswith(self.prefix)],
               "processes": [str(p.pid) for p in self.procs if p.poll() is None]}
        return {k: v for k, v in out.items() if v}

    def destroy(self) -> Dict[str, List[str]]:
        """Kill what runs in the nodes, remove everything; returns ``leftovers()`` (empty: all gone)."""
        for n in self.nodes:
            if os.path.exists(f"/run/netns/{n.ns}"):
                self.kill_all(n)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if _is_group_leader(p.pid) else p.kill()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for ns in [n.ns for n in self.nodes] + [self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        return self.leftovers()


def _is_group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _print_recipe(argv: List[str]) -> None:
    if argv[:1] == ["up"]:
        nodes = TwoNodes(*(argv[1:2] or [None]))
        for cmd in setup_commands(nodes.prefix, nodes.subnet):
            print(shlex.join(cmd))
        for n in nodes.nodes:
            print(f"mkdir -p {NETNS_ETC}/{n.ns} && printf {shlex.quote(hosts_file(nodes.nodes))} "
                  f"> {NETNS_ETC}/{n.ns}/hosts")
    elif argv[:1] == ["down"] and len(argv) == 2:
        for ns in (f"{argv[1]}n1", f"{argv[1]}n2", f"{argv[1]}br"):
            print(f"ip netns del {ns}; rm -rf {NETNS_ETC}/{ns}")
    else:
        raise SystemExit("usage: nodes.py up [PREFIX] | down PREFIX")


if __name__ == "__main__":
    import sys
    _print_recipe(sys.argv[1:])
