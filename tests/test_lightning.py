"""``Trainer(strategy="shardwrap_stage_N")`` on 2 CPU devices, launched by Lightning's own launcher
(tests/lightning_worker.py), against ``strategy="ddp"`` in the same launch and against the unwrapped
model trained in this process on the whole global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler

pytest.importorskip("lightning")  # the [lightning] extra; the test extra installs it

import lightning_worker as worker  # noqa: E402  (tests/ is on sys.path)
from shardwrap.lightning import export_lightning_checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["shardwrap_stage_1", "shardwrap_stage_2", "shardwrap_stage_3"]
CLIP_ACC = "clip=0.05:accumulate=2"


def launch(out: str, devices: int, *scenarios: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "tests", "lightning_worker.py"), out, str(devices), *scenarios]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every scenario, in two launches (2 devices, then 1 device resuming the 2-device checkpoints)."""
    out = str(tmp_path_factory.mktemp("lightning"))
    ck, full = os.path.join(out, "ck"), os.path.join(out, "full")
    two = [
        "ddp_sgd:ddp:sgd", "ddp_adam:ddp:adamw", f"ddp_ca:ddp:sgd:{CLIP_ACC}",
        f"ddp_bf:ddp:adamw:precision=bf16-mixed:{CLIP_ACC}", f"ddp_bfs:ddp:sgd:precision=bf16-mixed:{CLIP_ACC}",
        *(f"s{s[-1]}_sgd:{s}:sgd" for s in STAGES), *(f"s{s[-1]}_ca:{s}:sgd:{CLIP_ACC}" for s in STAGES),
        "s3_adam:shardwrap_stage_3:adamw", "s3off_adam:shardwrap_stage_3_offload:adamw", "s3off_sgd:shardwrap_stage_3_offload:sgd", f"s3_bf:shardwrap_stage_3:adamw:precision=bf16-mixed:{CLIP_ACC}",
        f"s3_bfs:shardwrap_stage_3:sgd:precision=bf16-mixed:{CLIP_ACC}",
        f"s3_save:shardwrap_stage_3:adamw:save={ck}", "s3_two:shardwrap_stage_3:adamw:epochs=2",
        f"s2_save:shardwrap_stage_2:sgd:save={ck}2:{CLIP_ACC}", f"s2_two:shardwrap_stage_2:sgd:epochs=2:{CLIP_ACC}",
        f"s3_full:shardwrap_stage_3:adamw:full=1:save={full}", "s2_fp16:shardwrap_stage_2:sgd:precision=16-mixed:inf_at=2",
        "s3_eval:shardwrap_stage_3:sgd:evaluate=1", "ddp_holding:ddp:sgd:prewrapped=1", "s3_meta:shardwrap_stage_3:sgd:meta=1",
        "s2_swa:shardwrap_stage_2:sgd:swa=1:epochs=2",
        f"s3_weights:shardwrap_stage_3:adamw:weights=1:save={ck}w", f"s3_wfull:shardwrap_stage_3:adamw:full=1:weights=1:save={full}w",
        "s1_ft:shardwrap_stage_1:sgd:finetune=1:epochs=2", "s3_ft:shardwrap_stage_3:sgd:finetune=1:epochs=2",
        "s2_fta:shardwrap_stage_2:adamw:finetune=1:epochs=2",
    ]
    launch(out, 2, *two)
    exported = os.path.join(out, "exported.ckpt")
    export_lightning_checkpoint(os.path.join(ck, "epoch=0.ckpt"), exported)
    one = [
        f"s3_resume:shardwrap_stage_3:adamw:epochs=2:resume={ck}/epoch=0.ckpt",
        f"s2_resume:shardwrap_stage_2:sgd:epochs=2:resume={ck}2/epoch=0.ckpt:{CLIP_ACC}",
        f"plain_resume:ddp:adamw:epochs=2:resume={exported}",
        f"s3_wresume:shardwrap_stage_3:adamw:full=1:epochs=2:resume={full}w/epoch=0.ckpt",
    ]
    launch(out, 1, *one)
    results = {name.split(":")[0]: torch.load(os.path.join(out, f"{name.split(':')[0]}.pt")) for name in two + one}
    results["_paths"] = {"ck": ck, "full": full, "exported": exported, "weights": ck + "w"}
    return results


def reference(
    optimizer: str, *, steps: int, clip: float | None = None, accumulate: int = 1, finetune: bool = False, unfreeze: bool = True,
) -> dict[str, torch.Tensor]:
    """The unwrapped model, one process, the global batch of both devices per micro-batch, the
    worker's optimizer and per-step StepLR; the loss of a micro-batch divided by ``accumulate``.
    ``finetune``: the worker's ``FROZEN`` frozen, and at the first step of epoch 1 (unless not
    ``unfreeze``) ``UNFROZEN`` unfrozen into a new group at a tenth of the first group's lr."""
    torch.manual_seed(1)
    net = worker.Net()
    named = lambda prefixes: [p for n, p in net.named_parameters() if f"net.{n}".startswith(prefixes)]  # noqa: E731
    if finetune:
        for p in named(worker.FROZEN):
            p.requires_grad_(False)
    opt = worker.make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dataset = worker.data()
    x, y = dataset.tensors
    batch = 2 * worker.BATCH
    per_epoch = len(x) // batch
    for step in range(steps):
        if finetune and unfreeze and step == per_epoch:
            for p in named(worker.UNFROZEN):
                p.requires_grad_(True)
            opt.add_param_group({"params": named(worker.UNFROZEN), "lr": opt.param_groups[0]["lr"] / 10})
        for micro in range(accumulate):
            epoch, k = divmod(step * accumulate + micro, per_epoch)
            # Lightning's training sampler: DistributedSampler(shuffle=True, seed=0), set_epoch(epoch);
            # the ranks' k-th batches together are this slice of its permutation.
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            rows = list(sampler)[k * batch : (k + 1) * batch]
            (nn.functional.cross_entropy(net(x[rows]), y[rows]) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {f"net.{k}": v for k, v in net.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["ddp_sgd", "s1_sgd", "s2_sgd", "s3_sgd"])
def test_training_equals_single_process_and_ddp(runs, name):
    ref = reference("sgd", steps=4)
    assert max_diff(runs[name]["params"], ref) < 1e-5
    assert max_diff(runs[name]["params"], runs["ddp_sgd"]["params"]) < 1e-6
    assert runs[name]["lr"] == runs["ddp_sgd"]["lr"] == 0.05  # the scheduler stepped 4 times
    # The oracle can fail: one step less, or the loss of one rank's half only, is far away.
    assert max_diff(runs[name]["params"], reference("sgd", steps=3)) > 1e-3


@pytest.mark.parametrize("name,optimizer", [("s1_ft", "sgd"), ("s3_ft", "sgd"), ("s2_fta", "adamw")])
def test_base_finetuning_unfreezes_a_backbone_frozen_before_wrapping(runs, name, optimizer):
    """Lightning's BaseFinetuning freezes in its setup hook, before the strategy wraps the model,
    and unfreezes into a new param group at epoch 1: the single-process numbers (DDP cannot do
    this: it leaves out what was frozen when it wrapped)."""
    assert max_diff(runs[name]["params"], reference(optimizer, steps=8, finetune=True)) < 1e-5
    # The oracle can fail: without the unfreezing, or without the freezing, it is far away.
    assert max_diff(runs[name]["params"], reference(optimizer, steps=8, finetune=True, unfreeze=False)) > 1e-3
    assert max_diff(runs[name]["params"], reference(optimizer, steps=8)) > 1e-3


@pytest.mark.parametrize("name", ["s3_adam", "s3off_adam"])
def test_adamw_equals_single_process_and_ddp(runs, name):
    assert max_diff(runs[name]["params"], reference("adamw", steps=4)) < 1e-5
    assert max_diff(runs[name]["params"], runs["ddp_adam"]["params"]) < 1e-6


def test_stage_3_offload_string_trains_sgd_like_ddp(runs):
    """strategy="shardwrap_stage_3_offload" (DeepSpeed's deepspeed_stage_3_offload)."""
    assert max_diff(runs["s3off_sgd"]["params"], runs["ddp_sgd"]["params"]) < 1e-6


@pytest.mark.parametrize("name", ["s1_ca", "s2_ca", "s3_ca"])
def test_clip_and_accumulate_equal_single_process(runs, name):
    """gradient_clip_val clips by the global norm; accumulate_grad_batches=2 (no_sync at stage 1)."""
    ref = reference("sgd", steps=2, clip=0.05, accumulate=2)
    assert max_diff(runs[name]["params"], ref) < 1e-5
    assert max_diff(runs[name]["params"], runs["ddp_ca"]["params"]) < 1e-6
    assert max_diff(runs[name]["params"], reference("sgd", steps=2, accumulate=2)) > 1e-3  # clipping mattered
    assert max_diff(runs[name]["params"], reference("sgd", steps=4, clip=0.05)) > 1e-3  # accumulation mattered


@pytest.mark.parametrize("optimizer, ddp, shard", [("sgd", "ddp_bfs", "s3_bfs"), ("adamw", "ddp_bf", "s3_bf")])
def test_bf16_mixed_matches_ddp_within_bf16(runs, optimizer, ddp, shard):
    """bf16-mixed against DDP's bf16-mixed (autocast) and the fp32 single-process run, as distances
    relative to the size of the fp32 run's update: shardwrap is as close to DDP as DDP's own bf16
    noise takes DDP from fp32."""
    fp32 = reference(optimizer, steps=2, clip=0.05, accumulate=2)
    torch.manual_seed(1)
    start = {f"net.{k}": v for k, v in worker.Net().state_dict().items()}
    update = sum(((fp32[k] - start[k]) ** 2).sum() for k in fp32) ** 0.5

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return float(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a) ** 0.5 / update)

    noise = distance(runs[ddp]["params"], fp32)  # bf16's own error, under DDP
    assert 0 < noise < 0.2
    assert distance(runs[shard]["params"], runs[ddp]["params"]) <= noise
    assert distance(runs[shard]["params"], fp32) <= 2 * noise


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(runs):
    """The last rank's gradient gets an inf at step 2; rank 0 (whose shard was finite) skips too."""
    assert runs["s2_fp16"]["skipped"] == [False, False, True, False]


def test_sync_dist_reduce_broadcast_barrier(runs):
    for name in ("s1_sgd", "s3_eval"):
        assert runs[name]["logged"] == [0.5] * 4  # mean of the ranks' 0 and 1, every step
    assert runs["s3_eval"]["reduced"] == 1.0 and runs["s3_eval"]["broadcast"] == "from rank 0"


def test_validate_and_predict_leave_nothing_behind(runs):
    run = runs["s3_eval"]
    assert run["idle"] and run["grads"] == 0
    net = worker.Net()
    net.load_state_dict({k[len("net."):]: v for k, v in run["params"].items()})
    x, y = worker.data().tensors
    with torch.no_grad():
        logits = net(x)
    assert run["val_loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), abs=1e-5)
    assert torch.equal(run["predictions"], logits.argmax(-1)[0::2])  # rank 0's DistributedSampler share


@pytest.mark.parametrize("saved, resumed", [("s3_two", "s3_resume"), ("s2_two", "s2_resume")])
def test_resume_from_two_devices_onto_one(runs, saved, resumed):
    """A checkpoint taken after epoch 0 on 2 devices, resumed on 1 device for epoch 1, ends where
    2 devices running both epochs end: model, optimizer state (momentum, Adam moments, step) and
    LR scheduler."""
    assert runs[resumed]["world"] == 1
    assert runs[resumed]["lr"] == runs[saved]["lr"]
    assert max_diff(runs[resumed]["params"], runs[saved]["params"]) < 1e-5
    assert len(runs[resumed]["logged"]) == len(runs[saved]["logged"]) // 2  # only epoch 1 ran


def test_sharded_checkpoint_is_an_atomic_checksummed_directory(runs):
    path = os.path.join(runs["_paths"]["ck"], "epoch=0.ckpt")
    names = sorted(os.listdir(path))
    assert "shardwrap-manifest.json" in names and "lightning-state.pt" in names and ".metadata" in names
    assert not [n for n in os.listdir(runs["_paths"]["ck"]) if ".tmp-" in n or ".old-" in n]


def test_weights_only_checkpoints_leave_the_optimizer_out(runs):
    # ModelCheckpoint(save_weights_only=True) wrote the optimizer's shards anyway (an audit: 27 of
    # 43 entries, Adam's state twice the model); resuming fit from a weights-only full file said
    # "could not be read (KeyError: 'optimizer_states')".
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(os.path.join(runs["_paths"]["weights"], "epoch=0.ckpt")).read_metadata().state_dict_metadata
    assert keys and not [k for k in keys if k.startswith("optim")] and [k for k in keys if k.startswith("model")], sorted(keys)
    assert "optimizer_states" not in torch.load(os.path.join(runs["_paths"]["full"] + "w", "epoch=0.ckpt"), weights_only=True)
    assert "holds the model only" in runs["s3_wresume"]["error"] and "save_weights_only" in runs["s3_wresume"]["error"]


def test_full_checkpoint_loads_into_a_plain_lightning_module(runs):
    path = os.path.join(runs["_paths"]["full"], "epoch=0.ckpt")
    assert os.path.isfile(path)
    plain = worker.Classifier.load_from_checkpoint(path, map_location="cpu")  # calls configure_model
    got = {k: v for k, v in plain.state_dict().items()}
    assert max_diff(got, runs["s3_full"]["params"]) == 0.0
    content = torch.load(path, weights_only=True)
    assert set(content["optimizer_states"][0]["state"]) == set(range(len(got)))  # a plain optimizer's keys


def test_exported_sharded_checkpoint_is_the_full_file_and_a_plain_run_resumes_from_it(runs):
    """export_lightning_checkpoint(directory) gives what save_distributed_checkpoint=False writes at
    the same point of the same run; a plain DDP Trainer on 1 device resumes from it exactly."""
    exported = torch.load(runs["_paths"]["exported"], weights_only=True)
    full = torch.load(os.path.join(runs["_paths"]["full"], "epoch=0.ckpt"), weights_only=True)
    assert max_diff(exported["state_dict"], full["state_dict"]) == 0.0
    mine, theirs = exported["optimizer_states"][0], full["optimizer_states"][0]
    assert mine["param_groups"] == theirs["param_groups"] and mine["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        assert all(torch.equal(torch.as_tensor(state[k]), torch.as_tensor(mine["state"][i][k])) for k in state)
    assert exported["lr_schedulers"] == full["lr_schedulers"] and exported["global_step"] == full["global_step"]
    assert max_diff(runs["plain_resume"]["params"], runs["s3_two"]["params"]) < 1e-5
    assert runs["plain_resume"]["lr"] == runs["s3_two"]["lr"]


def test_ddp_around_a_sharded_module_is_refused(runs):
    error = runs["ddp_holding"]["error"]
    assert error.startswith("TypeError") and "shardwrap_stage_" in error and "net" in error


def test_meta_model_without_init_is_refused(runs):
    error = runs["s3_meta"]["error"]
    assert "meta device" in error and "param_init_fn" in error and "Unresettable" in error


def test_stochastic_weight_averaging_is_refused_before_wrapping(runs):
    # It averages into a copy made before wrapping; DTensor's "mixed torch.Tensor and DTensor" came
    # at its first average, an epoch in. Lightning refuses it for its own sharded strategies.
    error = runs["s2_swa"]["error"]
    assert error.startswith("ValueError") and "StochasticWeightAveraging" in error and "_foreach_lerp_" in error, error


def test_unknown_stage_is_refused_before_launch():
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match="shardwrap_stage_4"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="shardwrap_stage_4")
    with pytest.raises(ValueError, match="stage"):
        worker.ShardwrapStrategy(stage=4)
