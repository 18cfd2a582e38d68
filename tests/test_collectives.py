"""The pairwise reduce-scatter and all-gather of CPU groups against torch's gloo collectives
(design/notes/cpu-collectives.md): the same results at W = 2, 3 and 4, odd sizes, fp32, bf16 and
fp16; bit-identical at W = 2; the same bits on every run; waited on like torch's Work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import run_on_ranks

from shardwrap import collectives

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _against_torch(sizes: list[int], dtype_name: str) -> list[dict]:
    """Runs on every rank: for each size, shardwrap's collectives (pairwise: the harness sets the
    threshold to 1 byte) and torch's own on the same inputs, twice each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[dtype_name]
    group = dist.group.WORLD
    out = []
    for n in sizes:
        g = torch.Generator().manual_seed(1000 * rank + n)
        padded = torch.randn(world * n, generator=g).to(dtype)
        shard = torch.randn(n, generator=g).to(dtype)
        ours, theirs, again = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        work = collectives.reduce_scatter(ours, padded, group, async_op=True)
        assert isinstance(work, collectives.PairwiseWork)
        collectives.wait(work)
        collectives.wait(work)  # a second wait does nothing (the waiter thread and the unit both wait)
        collectives.reduce_scatter(again, padded, group)
        dist.reduce_scatter_tensor(theirs, padded, group=group)
        gathered, torch_gathered = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
        collectives.wait(collectives.all_gather(gathered, shard, group, async_op=True))
        dist.all_gather_into_tensor(torch_gathered, shard, group=group)
        exact = padded.view(world, n).double()  # every rank's input, for the exact sum
        everyone = [torch.empty_like(exact) for _ in range(world)]
        dist.all_gather(everyone, exact)
        truth = torch.stack([e[rank] for e in everyone]).sum(0)
        out.append({
            "rs": ours, "rs_torch": theirs, "rs_again": again, "truth": truth,
            "ag_equal": torch.equal(gathered, torch_gathered),
        })
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
def test_equal_to_torch(world, dtype_name):
    sizes = [1, 7, 1000, 4099]
    for rank_results in run_on_ranks(world, _against_torch, sizes, dtype_name):
        for r in rank_results:
            assert r["ag_equal"]  # an all-gather moves bytes: always bit-identical
            assert torch.equal(r["rs"], r["rs_again"])  # the same bits on every run
            if world == 2:  # a + b == b + a: bit-identical to gloo's sum
                assert torch.equal(r["rs"], r["rs_torch"])
            else:  # another summation order: within one rounding of the exact sum per addition
                tol = {"fp32": 1e-5, "bf16": 4e-2, "fp16": 4e-3}[dtype_name]
                scale = r["truth"].abs().max().item() + 1
                assert (r["rs"].double() - r["truth"]).abs().max().item() <= tol * scale * world
                assert (r["rs_torch"].double() - r["truth"]).abs().max().item() <= tol * scale * world


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=4), world=st.integers(2, 3))
def test_generated_sizes(sizes, world):
    for rank_results in run_on_ranks(world, _against_torch, sizes, "fp32"):
        for r in rank_results:
            assert r["ag_equal"] and torch.equal(r["rs"], r["rs_again"])
            if world == 2:
                assert torch.equal(r["rs"], r["rs_torch"])
            else:
                torch.testing.assert_close(r["rs"].double(), r["truth"], rtol=1e-5, atol=1e-5)


def _counted(n: int) -> dict:
    """Runs on every rank: the counter counts the logical collective, whatever path ran."""
    world = dist.get_world_size()
    with collectives.count_collectives() as counts:
        collectives.reduce_scatter(torch.empty(n), torch.ones(world * n), dist.group.WORLD)
        collectives.all_gather(torch.empty(world * n), torch.ones(n), dist.group.WORLD)
    return dict(counts)


def test_counter_counts_the_logical_collective():
    for counts in run_on_ranks(2, _counted, 100):
        assert counts["reduce_scatter"] == 200 and counts["all_gather"] == 100, counts


def _peers_started(world_size: int) -> dict:
    """After a barrier, rank 0 starts a pairwise reduce-scatter at once; the others 1.5 s later.
    Rank 0 reads ``peers_started`` 0.2 s in while another thread waits for the work: false before
    the others posted their parts, true once the wait returned."""
    import threading
    import time

    rank, n = dist.get_rank(), 1000
    dist.barrier()
    if rank:
        time.sleep(1.5)
    out = torch.empty(n)
    work = collectives.reduce_scatter(out, torch.full((world_size * n,), float(rank + 1)), dist.group.WORLD, async_op=True)
    assert isinstance(work, collectives.PairwiseWork)
    waiter = threading.Thread(target=work.wait)
    waiter.start()
    time.sleep(0.2)
    early = work.peers_started
    waiter.join()
    return {"early": early, "late": work.peers_started, "sum": out.tolist() == [float(sum(range(1, world_size + 1)))] * n}


@pytest.mark.parametrize("world", [2, 3])
def test_a_pairwise_work_knows_when_every_peer_started_it(world):
    """The bound on reduce-scatters in flight waits for one only when every peer started it
    (design/notes/collective-schedule.md); a pairwise one says so once every receive landed."""
    results = run_on_ranks(world, _peers_started, world)
    assert results[0]["early"] is False and all(r["late"] and r["sum"] for r in results), results


# ---- a unit's collectives as one message per peer -------------------------------------------------


def _one_message_per_peer(case, world_size: int, form: str) -> dict:
    """``parity.train_sharded`` with every unit's all-gather and reduce-scatter sent as one
    contiguous message per peer (the form units of many small parameters take; the harness makes
    every unit send pieces), or (``form="torch"``) with every collective torch's own (what an
    NCCL group runs), and which form each unit's reduce-scatter took."""
    import parity

    saved = collectives.PIECES_MIN_BYTES, collectives.PAIRWISE_MIN_BYTES
    collectives.PIECES_MIN_BYTES = 1 << 40
    if form == "torch":
        collectives.PAIRWISE_MIN_BYTES = 1 << 40
    try:
        result = parity.train_sharded(case)
        from shardwrap import ShardedModule

        model = ShardedModule(parity.build_model(case), auto_wrap_policy=parity.resolve_policy(case), stage=case.stage)
        result["direct"] = [u._reduces_directly() for u in model.units if u.has_trainable]
    finally:
        collectives.PIECES_MIN_BYTES, collectives.PAIRWISE_MIN_BYTES = saved
    return result


@pytest.mark.parametrize("form", ["one message", "torch"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_units_sending_one_message_per_peer_match_the_single_process_model(stage, optim, form):
    from parity import Case, compare

    case = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", optim=optim, stage=stage)
    results = run_on_ranks(2, _one_message_per_peer, case, 2, form)
    assert all(not any(r["direct"]) for r in results), [r["direct"] for r in results]
    compare(case, 2, results)


def test_a_unit_sends_pieces_only_when_they_are_large():
    # 13 pieces of 0.12 MB (a GPT-2 block at W=2) go as one message; 3 pieces of 2.7 MB as pieces
    sizes = {"gpt2 block": (1_580_000, 13), "recipe linear": (8_004_004, 3)}
    defaults = collectives.PIECES_MIN_BYTES, collectives.PAIRWISE_MIN_BYTES  # this process: the library's own
    got = run_on_ranks(2, _sends_pieces, sizes, defaults)
    for r in got:
        assert r == {"gpt2 block": False, "recipe linear": True}, r


def _sends_pieces(sizes: dict, defaults: tuple[int, int]) -> dict:
    saved = collectives.PIECES_MIN_BYTES, collectives.PAIRWISE_MIN_BYTES  # the harness sets both to 1
    collectives.PIECES_MIN_BYTES, collectives.PAIRWISE_MIN_BYTES = defaults
    try:
        cpu = torch.device("cpu")
        return {k: collectives.sends_pieces(dist.group.WORLD, cpu, n, pieces) for k, (n, pieces) in sizes.items()}
    finally:
        collectives.PIECES_MIN_BYTES, collectives.PAIRWISE_MIN_BYTES = saved


_WITHOUT_CPU_BACKEND = """
import socket, torch, torch.distributed as dist
from shardwrap import collectives
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
# gloo registered for CUDA tensors only: like an NCCL-only group, it carries no host tensor
dist.init_process_group("cuda:gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
try:
    out = torch.empty(2, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([1, 2]), group=dist.group.WORLD)
    print("host tensor: carried")
except RuntimeError as e:
    print("host tensor: refused" if "No backend type associated with device type cpu" in str(e) else f"host tensor: {e}")
print("carrier:", collectives.carrier_device(dist.group.WORLD).type)
dist.destroy_process_group()
"""


def test_small_collectives_use_a_device_the_group_carries():
    """``all_gather_ints`` (the construction-time model check, the headers) put host tensors on
    every group until a review found that an NCCL-only group refuses them: every ShardedModule of
    two or more GPUs on ``init_process_group("nccl")`` raised while wrapping. A group of gloo for
    CUDA tensors alone stands in for NCCL here, on the CPU."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_CPU_BACKEND], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "host tensor: refused" in done.stdout, done.stdout  # the stand-in behaves like NCCL
    assert "carrier: cuda" in done.stdout, done.stdout
    [found] = run_on_ranks(1, _carrier_type)
    assert found == "cpu"  # a gloo group keeps its small tensors on the host


def _carrier_type() -> str:
    return collectives.carrier_device(dist.group.WORLD).type


class _Part:
    """One send or receive of a pairwise collective: records its wait, and fails if told to."""

    def __init__(self, log: list[str], name: str, fails: bool = False) -> None:
        self.log, self.name, self.fails = log, name, fails

    def wait(self) -> bool:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} failed")
        return True


def test_a_failed_part_ends_the_wait_and_is_raised_again():
    """A pairwise collective whose receive fails (a peer went away, a timeout) stops there: it never
    says its peers started, never takes the sum over partial data, and raises the same failure
    at every later wait, as torch's ``Work`` does; it never reports success."""
    log: list[str] = []
    summed = []
    parts = [_Part(log, "send 0"), _Part(log, "send 1"), _Part(log, "recv 0", fails=True), _Part(log, "recv 1")]
    work = collectives.PairwiseWork(parts, lambda: summed.append(True), sends=2)
    with pytest.raises(RuntimeError, match="recv 0 failed"):
        work.wait()
    assert log == ["recv 0"] and not work.peers_started and not summed
    with pytest.raises(RuntimeError, match="recv 0 failed"):
        work.wait()
    assert log == ["recv 0"] and not summed
    ok = collectives.PairwiseWork([_Part(log, "send"), _Part(log, "recv")], lambda: summed.append(True), sends=1)
    ok.wait()
    ok.wait()
    assert log == ["recv 0", "recv", "send"] and ok.peers_started and summed == [True]


def test_a_failed_sum_is_raised_again():
    """The reduce waiter thread may be the first to wait on a reduce-scatter: if the sum itself
    fails there, the unit's own wait after it must raise the same failure, not return as though
    the output had been written."""
    log: list[str] = []
    calls: list[int] = []

    def failing_sum() -> None:
        calls.append(1)
        raise RuntimeError("the sum failed")

    work = collectives.PairwiseWork([_Part(log, "send"), _Part(log, "recv")], failing_sum, sends=1)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the sum failed"):
            work.wait()
    assert calls == [1] and log == ["recv", "send"]
