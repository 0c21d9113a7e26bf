"""Two nodes on this machine (two network namespaces joined by a veth pair), one rank each (issue 48).

The same run is launched across them by ``launch/train_multinode.sh`` with torchrun (c10d rendezvous,
``--max-restarts``: the multi-node launch the README shows first) and with the project's launcher
(``LAUNCHER=gspo``); both finish, and node 1's
output (a rank other than 0) shows no unreviewed warning. Needs root and ``ip netns`` (skipped, saying
so, where either is missing); the namespaces are removed afterwards, which removes the veth pair.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from gspo_megatron.testing.processes import kill_run_processes, marked_env
from gspo_megatron.testing.train_runs import FAST, WARNING_LINE, read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train_multinode.sh"
SUBNET = "10.231.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_nodes():
    """[(namespace, interface, address)] for nodes 0 and 1."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("two network namespaces need root and iproute2's `ip`")
    tag = uuid.uuid4().hex[:6]
    subnet = int(tag[:2], 16)  # 10.231.<0-255>.0/24: two tests at once do not meet
    nodes = [(f"gspo{tag}n{i}", f"gv{tag}{i}", SUBNET.format(subnet, i + 1)) for i in range(2)]
    try:
        for namespace, _, _ in nodes:
            _ip("netns", "add", namespace)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"`ip netns add` is not allowed here: {error.stderr.strip()}")
    try:
        (ns0, if0, _), (ns1, if1, _) = nodes
        _ip("link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1)
        for namespace, interface, address in nodes:
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield nodes
    finally:
        for namespace, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


@pytest.mark.parametrize("launcher", ["torchrun", "gspo"])
def test_launch_script_runs_across_two_nodes(tmp_path, two_nodes, launcher):
    """``launch/train_multinode.sh`` as the README shows it, on each node: torchrun (c10d rendezvous,
    elastic restarts) by default, or the project's launcher."""
    master = two_nodes[0][2]
    run_dir = tmp_path / "run"  # one file system, as a cluster's shared one
    env, marker = marked_env(dict(os.environ, OMP_NUM_THREADS="1"))
    for variable in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    nodes = []
    try:
        for node, (namespace, interface, address) in enumerate(two_nodes):
            command = ["ip", "netns", "exec", namespace, "bash", str(SCRIPT), f"run_dir={run_dir}", *FAST]
            node_env = dict(env, NNODES="2", NODE_RANK=str(node), MASTER_ADDR=master, NPROC_PER_NODE="1")
            # a namespace resolves no host name: the interface and this node's address on it
            node_env.update(LAUNCHER=launcher, SOCKET_IFNAME=interface, LOCAL_ADDR=address)
            with (tmp_path / f"node{node}.log").open("w") as log:  # files: neither node blocks on a full pipe
                nodes.append(subprocess.Popen(command, env=node_env, stdout=log, stderr=subprocess.STDOUT))
        for node in nodes:
            node.wait(timeout=600)
    finally:
        kill_run_processes(marker)
    outputs = [(tmp_path / f"node{node}.log").read_text(errors="replace") for node in range(2)]
    for index, (node, output) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {index}: {output[-4000:]}"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    assert "run summary: 2 steps" in outputs[0]
    assert WARNING_LINE.findall(outputs[1]) == [], outputs[1][-4000:]
