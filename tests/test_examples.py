"""The examples run end to end under torchrun on 2 CPU ranks and do what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, *args: str, timeout: int = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_train_gpt2_loss_goes_down_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = torchrun("examples/train_gpt2.py", "--steps", "40", "--log-every", "20", "--save-every", "20", "--ckpt-dir", ckpt,
                   "--grad-accum", "2")
    first, last = map(float, re.search(r"done: loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 1.0, out
    assert sorted(os.listdir(ckpt)) == ["step_000020", "step_000040"]
    out = torchrun("examples/train_gpt2.py", "--steps", "50", "--log-every", "10", "--ckpt-dir", ckpt, "--resume", "auto")
    assert "starting at step 40" in out and "done: loss" in out, out


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
    cmd = [sys.executable, "benchmarks/cuda_check.py", "--device", "cpu", "--quick"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "all checks passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"\| shardwrap s\d( bf16)? \| .* \| (True|False) \|", out.stdout)
    assert len(rows) == 6 and all(ok == "True" for _, ok in rows), out.stdout
