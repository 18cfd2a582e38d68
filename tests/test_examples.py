"""The examples run end to end under torchrun on 2 CPU ranks and do what they promise."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, *args: str, timeout: int = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def losses(out: str) -> dict[int, str]:
    """Every logged step's loss, as printed."""
    return {int(s): loss for s, loss in re.findall(r"step\s+(\d+) loss ([\d.]+)", out)}


def test_train_gpt2_loss_goes_down_and_resumes_exactly(tmp_path):
    """20 steps in one run against 10 steps, a checkpoint, and 10 more in a new run resumed from
    it: the same losses at steps 11-20 and the same final model and optimizer, bit for bit. The
    text is cut to 96 windows (6 steps of 2 ranks x 8 windows per epoch), so both runs cross
    epochs and the checkpoint at step 10 is 4 batches into epoch 1."""
    from shardwrap import export_to_torch_save

    data = tmp_path / "text.txt"
    with open(os.path.join(ROOT, "examples", "data", "corpus.txt"), encoding="utf-8") as f:
        data.write_bytes(f.read().encode("utf-8")[: 96 * 64 + 1])  # 96 windows of 64 bytes (+1 target)
    common = ["--steps", "20", "--log-every", "1", "--save-every", "10", "--data", str(data), "--grad-accum", "2"]
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    out = torchrun("examples/train_gpt2.py", *common, "--ckpt-dir", whole)
    first, last = map(float, re.search(r"done: loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 1.0, out
    assert sorted(os.listdir(whole)) == ["step_000010", "step_000020"]
    shutil.copytree(os.path.join(whole, "step_000010"), os.path.join(resumed, "step_000010"))
    out_resumed = torchrun("examples/train_gpt2.py", *common, "--ckpt-dir", resumed, "--resume", "auto")
    assert "starting at step 10 (epoch 1, batch 4)" in out_resumed and "done: loss" in out_resumed, out_resumed

    assert sorted(losses(out)) == list(range(1, 21)) and sorted(losses(out_resumed)) == list(range(11, 21))
    assert {s: v for s, v in losses(out).items() if s > 10} == losses(out_resumed), (out, out_resumed)
    # The final model and optimizer state (AdamW moments and step), bit for bit.
    a, b = (torch.load(export(os.path.join(run, "step_000020")), weights_only=True) for run in (whole, resumed))
    assert len(a["model"]) > 10 and len(a["optim"]["state"]) == len(a["model"]) - 1  # lm_head is tied
    assert identical(a, b)


def identical(a, b) -> bool:
    """Equal down to the last bit: tensors by value and dtype, containers recursively."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def export(checkpoint: str) -> str:
    from shardwrap import export_to_torch_save

    export_to_torch_save(checkpoint, checkpoint + ".pt")
    return checkpoint + ".pt"


def test_zero_recipe_sums_agree_and_memory_halves():
    out = torchrun("examples/zero_recipe.py")
    rows = re.findall(r"(ddp|stage \d)\s+rank (\d): after wrap\s+([\d.]+) MiB .* after step\s+([\d.]+) MiB .* sum of parameters (-?[\d.]+)", out)
    assert len(rows) == 8, out
    assert len({r[4] for r in rows}) == 1, rows  # the same sum everywhere
    ddp_after = float(next(r[3] for r in rows if r[0] == "ddp"))
    s3_after = float(next(r[3] for r in rows if r[0] == "stage 3"))
    assert abs(s3_after / ddp_after - 0.5) < 0.01, (s3_after, ddp_after)  # 2 ranks: half


def test_text_classifier_learns():
    out = torchrun("examples/text_classifier.py", "--stage", "3", "--epochs", "2")
    accuracy = float(re.search(r"held-out accuracy ([\d.]+)%", out).group(1))
    assert accuracy > 90, out


def test_cuda_check_plumbing_runs_on_cpu():
    """benchmarks/cuda_check.py is run by hand on a GPU machine; its parity, timing and main-job
    parts run here on gloo so that it does not rot between GPU sessions."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # every case but "offload on the device", whose command test_offload_cuda_plumbing_runs_on_cpu runs as it is
    only = "parity,clip,offload extras,unused and frozen,syncs,overlap,speed,main job"
    cmd = [sys.executable, "benchmarks/cuda_check.py", "--device", "cpu", "--quick", "--only", only]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "all checks passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"\| shardwrap s\d( bf16)? \| .* \| (True|False) \|", out.stdout)
    assert len(rows) == 6 and all(ok == "True" for _, ok in rows), out.stdout



def test_hook_time_plumbing_runs_on_cpu():
    """benchmarks/hook_time.py is for a GPU session (where backward's hooks run on autograd's
    device thread); here it runs on gloo and must time shardwrap's hooks, so that the timers
    still find the functions they wrap."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/hook_time.py", "--device", "cpu", "--steps", "11", "--top", "60"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("== fully_shard:") == 2 and out.stdout.count("== shardwrap s3:") == 2, out.stdout
    for name in ("Unit.pre_backward", "Unit.post_backward", "collectives.reduce_scatter"):
        assert re.search(rf"{re.escape(name)} +\d+\.\d+ ms a backward +3\.0 calls", out.stdout), (name, out.stdout)


def test_offload_cuda_plumbing_runs_on_cpu():
    """benchmarks/offload_cuda.py is run by hand on a GPU machine; here its timing and loss checks
    run on gloo (host-to-host copies), so that it does not rot between GPU sessions. SGD with
    momentum: under Adam a gradient off by a constant factor leaves the losses equal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/offload_cuda.py", "--device", "cpu", "--quick", "--optimizer", "sgd"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "all checks passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    gaps = re.findall(r"\| (?:single|shardwrap s\d(?: cpu-offload)?) @ \d+x\d+ \|.* \| ([\d.e+-]+) \|", out.stdout)
    assert len(gaps) == 8 and all(float(g) <= 1e-4 for g in gaps), out.stdout


def test_lightning_classifier_learns():
    """examples/lightning_classifier.py under Lightning's own launcher (2 CPU processes, no
    torchrun): DDP and shardwrap stages 1-3 in one launch, each learning the generated sentiment
    task, with each rank's model state in ZeRO's order (2 ranks, fp32 AdamW: DDP 16 bytes per
    parameter, stage 1 4 + 4 + 8/2, stage 2 adds only the unsharded parameters it keeps from
    forward to backward to its 16/2, stage 3 only the units it holds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "examples/lightning_classifier.py", "--strategy", "all", "--epochs", "1"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        name: (float(acc), float(ms), [float(m) for m in mib.split("/")])
        for name, acc, ms, mib in re.findall(
            r"^\| (ddp|shardwrap_stage_\d) \| ([\d.]+) \| ([\d.]+) \| ([\d. /]+) \| [\d.]+ \|$", out.stdout, re.M
        )
    }
    assert sorted(rows) == ["ddp", "shardwrap_stage_1", "shardwrap_stage_2", "shardwrap_stage_3"], out.stdout
    for name, (accuracy, step_ms, mib) in rows.items():
        assert accuracy >= 0.9, (name, out.stdout)  # chance is 0.5; 0.98 after one epoch
        assert step_ms > 0 and len(mib) == 2, (name, out.stdout)
    memory = {name: max(mib) for name, (_, _, mib) in rows.items()}
    assert memory["shardwrap_stage_1"] < memory["ddp"], out.stdout
    assert memory["shardwrap_stage_2"] < memory["shardwrap_stage_1"], out.stdout
    assert memory["shardwrap_stage_3"] < memory["shardwrap_stage_2"], out.stdout
    assert abs(memory["shardwrap_stage_1"] / memory["ddp"] - 0.75) < 0.01, out.stdout  # (4 + 4 + 4) / 16


def test_a_process_that_exits_right_after_a_collective_exits_cleanly(tmp_path):
    """A process that returns from its script while a gloo worker thread still has to drop a
    finished collective's tensor exits with 0, not SIGABRT ("terminate called without an active
    exception"; design/notes/failure-modes.md, "An abort at exit"): the race that ended an
    example's rank and a Lightning worker once each, built on purpose by tests/exit_worker.py."""
    flags = tmp_path / "flags"
    flags.write_bytes(bytes(3))
    torchrun("tests/exit_worker.py", str(flags), timeout=120)
    assert flags.read_bytes()[:2] == b"\x01\x01", "rank 0 did not see rank 1 finish: the race was not built"
