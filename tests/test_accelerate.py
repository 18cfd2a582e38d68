"""A Hugging Face accelerate loop around a ShardedModule (tests/accelerate_worker.py under torchrun)
trains like the unwrapped model in one process; accelerate's save_state with the model registered
is refused on every rank instead of loading rank 0's shards everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import accelerate_worker as worker
import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference(kind: str) -> dict[str, torch.Tensor]:
    """One process, the whole global batch per micro-batch, the loss divided by the accumulation
    steps (as accelerator.backward does), clipping and the schedule at each window's end."""
    torch.manual_seed(0)
    model = models.gpt2()
    opt = worker.optimizer_for(model, kind)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for i, ids in enumerate(worker.token_batches().split(worker.GLOBAL_BATCH)):
        (model(input_ids=ids, labels=ids).loss / worker.ACCUMULATE).backward()
        if (i + 1) % worker.ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), worker.MAX_NORM)
            opt.step()
            opt.zero_grad()
            schedule.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("accelerate"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/accelerate_worker.py", out]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return torch.load(os.path.join(out, "results.pt"), weights_only=True)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_an_accelerate_loop_trains_like_one_process(results, stage, kind):
    want = reference(kind)
    got = results[f"s{stage}_{kind}"]
    assert set(got) == set(want)
    for name, value in want.items():
        tolerance = dict(rtol=1e-5, atol=1e-6) if kind == "sgd" else dict(rtol=1e-4, atol=1e-4)  # Adam amplifies summation order
        torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m: f"s{stage} {kind} '{name}': {m}")


def test_accelerate_save_state_with_the_model_registered_is_refused(results):
    # accelerate saves model.state_dict() from rank 0 alone and loads it on every rank: rank 1 got
    # rank 0's shards, silently (fully_shard does the same)
    assert "rank 0's shards, loaded on rank 1" in results["load_state"], results["load_state"]
