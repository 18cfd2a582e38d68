"""Two nodes on one machine: examples/launch_multinode.sh started twice, as node 0 and node 1, each
a torchrun agent with 2 local CPU ranks and the c10d rendezvous on 127.0.0.1. They train the main
job's GPT-2 with hybrid sharding (--replicate auto: shard within a node, replicate across the two)
and end with the parameters of one agent with 4 local ranks; and when node 1 dies mid-run, node 0
exits non-zero within seconds with an error that says a peer went away, instead of hanging."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny GPT-2 on the generated sentences: a few seconds of training once the ranks are up.
TINY = ["--data", "generated", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
        "--batch-size", "2", "--log-every", "1"]
TAG_VAR = "SHARDWRAP_MULTINODE_TEST"  # marks every process a test starts, so that cleanup finds them all


class Node:
    """One ``launch_multinode.sh`` (a torchrun agent and its ranks) in a process group of its own,
    its stdout and stderr read into ``lines`` by a thread so that neither pipe ever fills."""

    def __init__(self, nnodes: int, node_rank: int, nproc: int, port: int, *args: str, tag: str) -> None:
        self.tag = f"{tag}-{node_rank}"
        env = {
            **os.environ,
            "NNODES": str(nnodes), "NODE_RANK": str(node_rank), "GPUS_PER_NODE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDZV_ID": tag, "RDZV_JOIN_TIMEOUT": "60",
            "MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),  # this tree's shardwrap
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),  # its torchrun
            TAG_VAR: self.tag,
        }
        self.proc = subprocess.Popen(["bash", "examples/launch_multinode.sh", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.M):
            assert self.proc.poll() is None, f"node exited ({self.proc.returncode}) before {pattern!r}:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n{self.output[-4000:]}"
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def pids(self) -> list[int]:
        """The agent and every rank it started, found by the tag in their environment: the ranks
        run in sessions of their own (torchrun starts them so), and outlive a killed agent."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"{TAG_VAR}={self.tag}".encode() in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:  # gone, or not ours
                pass
        return found

    def kill(self) -> None:
        """SIGKILL the whole node at once, as a power cut would: the agent and every rank."""
        for pid in self.pids():
            try:
                group = os.getpgid(pid)
                if group != os.getpgid(0):  # never the test's own group (each node has a session of its own)
                    os.killpg(group, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, node: Node, timeout: float = 60) -> None:
    """Node 0's agent hosts the rendezvous store: start node 1 only once it listens, so that node 0
    is the host (on one machine both would match 127.0.0.1 and the first up would host)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert node.proc.poll() is None, f"node 0 exited ({node.proc.returncode}):\n{node.output[-4000:]}"
        assert time.monotonic() < deadline, f"node 0 did not listen on {port} within {timeout} s:\n{node.output[-4000:]}"
        time.sleep(0.1)


def start(nnodes: int, *args: str) -> list[Node]:
    port, tag = free_port(), f"shardwrap-{uuid.uuid4().hex[:8]}"
    nodes = [Node(nnodes, 0, 4 // nnodes, port, *args, tag=tag)]
    if nnodes == 2:
        wait_listening(port, nodes[0])
        nodes.append(Node(nnodes, 1, 2, port, *args, tag=tag))
    return nodes


def run(nnodes: int, *args: str, timeout: float = 240) -> str:
    """Train to the end on 4 ranks: ``nnodes`` agents of 4 / nnodes ranks; rank 0's output."""
    nodes = start(nnodes, *args)
    try:
        try:
            rcs = [node.finish(timeout) for node in nodes]
        except subprocess.TimeoutExpired:  # say where each node stopped
            for node in nodes:
                node.kill()
                node.reader.join(timeout=10)
            tails = "\n".join(f"node {i}:\n{n.output[-3000:]}" for i, n in enumerate(nodes))
            raise AssertionError(f"training on {nnodes} agent(s) did not end within {timeout} s:\n{tails}") from None
        assert rcs == [0] * nnodes, "\n".join(f"node {i} exit {rc}:\n{n.output[-4000:]}" for i, (n, rc) in enumerate(zip(nodes, rcs)))
        return nodes[0].output
    finally:
        for node in nodes:
            node.kill()


def losses(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"step\s+(\d+) loss ([\d.]+)", out)}


def test_two_agents_hybrid_equal_one_agent_of_four_ranks(tmp_path):
    """2 agents x 2 ranks, mesh (replicate 2, shard 2), against 1 agent x 4 ranks sharding over all
    4: the same global batches (the sampler deals by global rank), the same mean gradient, summed in
    another order (reduce-scatter over 2 then all-reduce over 2, against reduce-scatter over 4)."""
    steps = ["--steps", "6"]
    two = run(2, *TINY, *steps, "--final-state", str(tmp_path / "two.pt"))
    one = run(1, *TINY, *steps, "--final-state", str(tmp_path / "one.pt"))
    assert "2 replicas x 2 shards" in two and "4 ranks, stage 3" in one, (two, one)
    assert sorted(losses(two)) == sorted(losses(one)) == list(range(1, 7)), (two, one)
    assert all(abs(float(losses(two)[s]) - float(losses(one)[s])) < 1.5e-4 for s in range(1, 7)), (two, one)
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("two.pt", "one.pt"))
    assert len(a) > 10 and sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    print(f"largest difference: {max((a[n] - b[n]).abs().max().item() for n in a):.3g}")


def test_a_dead_node_fails_the_other_fast_with_a_clear_error():
    """SIGKILL node 1 (its agent and both ranks) after the first logged step: node 0's ranks see
    their peers' connections close in the next collective, raise, and node 0's agent, with
    --max_restarts=0, stops its other rank and exits 1 with a failure summary. Bounded by the
    process group's timeout (--timeout 30) if a collective hung instead."""
    nodes = start(2, *TINY, "--steps", "100000", "--timeout", "30")
    try:
        nodes[0].wait_for(r"^step\s+1 loss", timeout=180)
        nodes[1].kill()
        killed = time.monotonic()
        rc = nodes[0].finish(timeout=90)
        took = time.monotonic() - killed
        out = nodes[0].output
        assert rc != 0 and took < 60, (rc, took, out[-4000:])
        # torchrun's failure summary, whose root cause is a rank of node 0 with the script's own
        # error (recorded by @record), the error gloo raised under it
        summary = out[out.index("examples/train_gpt2.py FAILED"):] if "examples/train_gpt2.py FAILED" in out else ""
        assert "Root Cause (first observed failure)" in summary, out[-4000:]
        assert re.search(r"rank [01] \(node 0\) lost its connection to another rank in step \d+:", summary), summary
        assert "Restart the job with --resume auto" in summary, summary
        assert re.search(r"Connection (closed|reset) by peer", out), out[-4000:]
        print(f"node 0 exited {rc} {took:.1f} s after node 1 was killed:\n{out[-3000:]}")
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.parametrize("replicate, world, local, error", [
    ("3", 4, 2, "--replicate 3 does not divide the 4 ranks"),
    ("0", 4, 2, "--replicate must be a whole number >= 1 or 'auto', not '0'"),
    ("auto", 4, 3, "--replicate auto: WORLD_SIZE=4 is not a multiple of LOCAL_WORLD_SIZE=3"),
])
def test_replicate_is_checked_before_torch_starts(replicate, world, local, error):
    """A --replicate that cannot make a mesh is a usage error on every rank, before any import of torch."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "examples/train_gpt2.py", "--replicate", replicate], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and error in out.stderr and "Traceback" not in out.stderr, out.stderr
