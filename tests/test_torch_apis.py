"""torch's own distributed APIs on a ShardedModule give the single-process answer: parameters and
gradients are DTensors, so ``torch.nn.utils.clip_grad_norm_``, ``torch.distributed.checkpoint``'s
``get_state_dict``/``set_state_dict`` (at another world size too), HF's ``save_pretrained`` and
the overridden ``nn.Module`` signatures work unchanged (design/notes/dtensor-parameters.md)."""

from __future__ import annotations

import copy
import inspect
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import models
from harness import run_on_ranks
from test_checkpoint import make, train
from parity import Case, assert_close_params, build_model, check_parity, compare, global_batch, placed_params, train_reference

MLP = Case("mlp", {"dim": 16, "depth": 3}, policy="Block")
GPT2 = Case("gpt2", {"n_layer": 2}, policy="GPT2Block", data="lm", seq=8)


def case(base: Case = MLP, **changes) -> Case:
    return Case(**{**base.__dict__, **changes})


# ---- parameters and gradients are DTensors ------------------------------------------------------


def on_ranks_dtensors() -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.scaled(), auto_wrap_policy={models.Block})
    plain = models.scaled()
    x = torch.randn(4, 16)
    model(x).pow(2).mean().backward()
    params = list(model.parameters())
    unit_params = {id(p) for u in model.units for p in u.sharded_params}
    return {
        "all_dtensor_params": all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in params),
        "global_shapes": [tuple(p.shape) for p in params] == [tuple(q.shape) for q in plain.parameters()],
        "placements": sorted({str(p.placements) for p in params}),
        "grads": all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in params),
        "locals_are_shard_views": all(
            p.to_local().untyped_storage().data_ptr() == u.sharded_local.untyped_storage().data_ptr()
            for u in model.units for p in u.sharded_params
        ),
        "owned": all(id(p) in unit_params for p in params),
    }


def test_parameters_and_gradients_are_dtensors_over_the_flat_shard():
    for r in run_on_ranks(2, on_ranks_dtensors):
        assert r["all_dtensor_params"] and r["global_shapes"] and r["grads"] and r["locals_are_shard_views"] and r["owned"], r
        assert r["placements"] == sorted({str((Replicate(),)), str((Shard(0),))}), r  # the 0-dim gain is replicated


# ---- torch.nn.utils.clip_grad_norm_ ---------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_clip_grad_norm_matches_the_unwrapped_model(stage, world_size, norm_type):
    # Every step clips (max_norm is below every step's norm) with torch's function; its total norm
    # must equal torch's on the unwrapped model and shardwrap's own method on every rank.
    check_parity(case(stage=stage, clip=0.05, clip_api="torch", norm_type=norm_type), world_size)


@pytest.mark.parametrize("clip_api", ["torch_foreach", "torch_split", "torch_value"])
@pytest.mark.parametrize("stage", [1, 3])
def test_torchs_other_clipping_functions_match_the_unwrapped_model(stage, clip_api):
    # clip_grad_norm_(..., foreach=True), get_total_norm + clip_grads_with_norm_ (torch >= 2.6's
    # split form, which HF Trainer and torchtitan use), clip_grad_value_: each on
    # model.parameters(), against the same call on the unwrapped model. Every step clips.
    check_parity(case(stage=stage, clip=0.05 if clip_api != "torch_value" else 0.002, clip_api=clip_api), 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_inf_norm_with_an_empty_shard_matches_the_unwrapped_model(stage):
    # The head has one row at W=2, so rank 1's shards of its weight and bias are empty. torch's
    # clip_grad_norm_(..., inf) then raises on rank 1 inside DTensor while rank 0 waits in the
    # norm's all-reduce (as on fully_shard: the README says so); model.clip_grad_norm_ skips
    # empty shards. Every step clips.
    check_parity(case(stage=stage, clip=0.05, norm_type=math.inf, build_kwargs={"dim": 16, "depth": 3, "out": 1}, out=1), 2)


def test_torch_clip_grad_norm_with_replicated_parameters_and_gpt2():
    check_parity(Case("scaled", policy="Block", clip=0.05, clip_api="torch"), 3)
    check_parity(case(GPT2, clip=0.3, clip_api="torch", optim="adamw"), 2)


# ---- torch.distributed.checkpoint.state_dict ------------------------------------------------------


def on_ranks_save(case: Case, path: str, steps: int, full: bool) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = make(case)
    train(case, model, opt, range(steps))
    if full:
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save({"model": msd, "optim": osd}, path)
        dist.barrier()
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return list(msd)


def on_ranks_resume(case: Case, path: str, start: int, full: bool, from_rank0: bool = False) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model, opt = make(case)
    if full and from_rank0:  # torchtune's load: only rank 0 reads the file, torch broadcasts it
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = torch.load(path, weights_only=True) if dist.get_rank() == 0 else {"model": {}, "optim": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # Two calls, as torchtune makes them: torch's set_state_dict takes an empty model dict
        # (every rank but 0 here) for "optimizer only" and skips the model's broadcast on those
        # ranks, so rank 0 waits in it alone (under fully_shard too)
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, opt, state["optim"], options=options)
    elif full:
        state = torch.load(path, weights_only=True)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(case, model, opt, range(start, case.steps))
    return {
        "full": model.full_state_dict(),
        **placed_params(case, model),
        "losses": [0.0] * case.steps,
        "norms": [],
    }


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_get_state_dict_saved_at_w4_resumes_at_w2_and_w3_on_the_same_trajectory(stage, optim, tmp_path):
    run = case(stage=stage, optim=optim, steps=4)
    expected, _, _ = train_reference(run)
    path = str(tmp_path / "ckpt")
    keys = run_on_ranks(4, on_ranks_save, run, path, 2, False)[0]
    assert keys == list(build_model(run).state_dict()), "keys must be the unwrapped model's"
    for world in (2, 3):
        results = run_on_ranks(world, on_ranks_resume, run, path, 2, False)
        compare(run, world, results, reference=(expected, [], []))


@pytest.mark.parametrize("stage", [1, 3])
def test_full_state_dict_options_round_trip_at_another_world_size(stage, tmp_path):
    run = case(GPT2, stage=stage, optim="adamw", steps=3)
    expected, _, _ = train_reference(run)
    path = str(tmp_path / "full.pt")
    keys = run_on_ranks(2, on_ranks_save, run, path, 1, True)[0]
    assert keys == list(build_model(run).state_dict())
    compare(run, 3, run_on_ranks(3, on_ranks_resume, run, path, 1, True), reference=(expected, [], []))


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_full_state_dict_broadcast_from_rank_0_resumes_on_the_same_trajectory(stage, optim, tmp_path):
    """``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``: rank 0 alone holds
    the file's tensors (torchtune loads pretrained weights so), torch broadcasts each and every
    rank keeps its chunk; model and optimizer resume on the one-process trajectory."""
    run = case(stage=stage, optim=optim, steps=3)
    expected, _, _ = train_reference(run)
    path = str(tmp_path / "full.pt")
    run_on_ranks(2, on_ranks_save, run, path, 1, True)
    compare(run, 3, run_on_ranks(3, on_ranks_resume, run, path, 1, True, True), reference=(expected, [], []))


def on_ranks_template(case: Case, path: str) -> dict:
    """The template flow: a fresh optimizer's sharded_optim_state_dict is complete (its state is
    created first), so DCP fills every entry."""
    import torch.distributed.checkpoint as dcp

    model, opt = make(case)
    template = {"model": model.state_dict(), "optim": model.sharded_optim_state_dict(opt)}
    dcp.load(template, checkpoint_id=path)
    model.load_state_dict(template["model"])
    model.load_sharded_optim_state_dict(opt, template["optim"])
    states = sum(len(s) for s in opt.state.values())
    train(case, model, opt, range(2, case.steps))
    return {"full": model.full_state_dict(), "local": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
            "losses": [0.0] * case.steps, "norms": [], "states": states}


def test_sharded_optim_state_dict_of_a_fresh_optimizer_is_a_full_template(tmp_path):
    run = case(stage=1, optim="sgd", steps=4)
    expected, _, _ = train_reference(run)
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, on_ranks_save, run, path, 2, False)
    results = run_on_ranks(2, on_ranks_template, run, path)
    assert all(r["states"] > 0 for r in results)
    compare(run, 2, results, reference=(expected, [], []))


# ---- Hugging Face save_pretrained, signatures -----------------------------------------------------


def on_ranks_save_pretrained(path: str) -> dict:
    from transformers import GPT2LMHeadModel

    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.gpt2(n_layer=2), auto_wrap_policy={models.gpt2_block_class()})
    try:
        model.module.save_pretrained(path)
        refused = "no error"
    except RuntimeError as exc:
        refused = str(exc)
    sd = model.full_state_dict()
    if dist.get_rank() == 0:
        model.module.save_pretrained(path, state_dict=sd)
    dist.barrier()
    loaded = GPT2LMHeadModel.from_pretrained(path).state_dict()
    full = model.full_state_dict(rank0_only=False)
    same = all(torch.equal(loaded[k], v) for k, v in full.items() if k in loaded)
    return {"refused": refused, "same": same, "written": not os.path.exists(os.path.join(path, "never"))}


def test_save_pretrained_refuses_shards_and_round_trips_full_weights(tmp_path):
    for r in run_on_ranks(2, on_ranks_save_pretrained, str(tmp_path / "hf")):
        assert "full_state_dict()" in r["refused"] and "state_dict=sd" in r["refused"], r["refused"]
        assert r["same"]


class ReturnsLoss(nn.Module):
    """A model whose forward can return its loss (``can_return_loss`` looks for this default)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None, return_loss: bool = True) -> torch.Tensor:
        return self.lin(x)


def hf_eval_dataset() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": row, "labels": row} for row in ids]


def trainer_evaluate(model: nn.Module, out: str) -> dict:
    """HF Trainer's evaluate() and predict(), no training: what they read from the model's class."""
    import warnings

    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True, per_device_eval_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args)
        metrics = trainer.evaluate(eval_dataset=hf_eval_dataset())
        predicted = trainer.predict(hf_eval_dataset())
    return {"label_names": trainer.label_names, "eval_loss": metrics.get("eval_loss"),
            "label_ids": None if predicted.label_ids is None else tuple(predicted.label_ids.shape)}


def on_ranks_hf_classes(out: str) -> dict:
    from transformers import BertConfig, BertForQuestionAnswering
    from transformers.utils.generic import can_return_loss, find_labels

    from shardwrap import ShardedModule

    torch.manual_seed(0)
    gpt2 = ShardedModule(models.gpt2(), auto_wrap_policy={models.gpt2_block_class()})
    qa = ShardedModule(BertForQuestionAnswering(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=16)))
    returns = ShardedModule(ReturnsLoss())
    return {"labels": find_labels(type(gpt2)), "qa_labels": find_labels(type(qa)),
            "returns_loss": (can_return_loss(type(returns)), can_return_loss(type(gpt2))),
            "same_class": type(gpt2) is type(ShardedModule(models.gpt2(), auto_wrap_policy={models.gpt2_block_class()})),
            **trainer_evaluate(gpt2, out)}


def test_hugging_face_reads_the_wrapped_models_labels_from_the_class(tmp_path):
    # Trainer takes label_names and can_return_loss from type(model).forward's signature; with
    # ShardedModule's (*args, **kwargs) there, evaluate() gave no eval_loss and predict() no
    # label_ids, silently (fully_shard gives both)
    torch.manual_seed(0)
    want = trainer_evaluate(models.gpt2(), str(tmp_path / "one"))
    assert want["label_names"] == ["labels"] and want["label_ids"] == (8, 16), want
    for r in run_on_ranks(2, on_ranks_hf_classes, str(tmp_path / "wrapped")):
        assert r["labels"] == ["labels"] and r["qa_labels"] == ["start_positions", "end_positions"], r
        assert r["returns_loss"] == (True, False) and r["same_class"], r
        assert r["label_names"] == want["label_names"] and r["label_ids"] == want["label_ids"], r
        assert r["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6), r


class GainBlock(nn.Module):
    """A 0-dim parameter first (a gain, CLIP's logit_scale): its optimizer state is replicated."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * torch.tanh(self.lin(x))


class SGDSubclass(torch.optim.SGD):
    """Not one of the optimizer classes whose step runs on the local tensors."""


def on_ranks_optimizer_saved_by_rank_0(path: str, kind: str) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(nn.Sequential(GainBlock(), GainBlock()), auto_wrap_policy={GainBlock})
    opt = (SGDSubclass if kind == "subclass" else torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    rank = dist.get_rank()
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    opt.load_state_dict(torch.load(path, weights_only=True))
    model(torch.randn(4, 16)).pow(2).mean().backward()
    try:
        opt.step()
        return {"refused": "no error"}
    except RuntimeError as exc:
        return {"refused": str(exc)}


@pytest.mark.parametrize("kind", ["sgd", "subclass"])
def test_another_ranks_optimizer_state_is_refused_past_a_replicated_state_and_for_any_optimizer(kind, tmp_path):
    # a 0-dim parameter's replicated state passed the check and marked its mesh as checked, so the
    # shards after it went through (a review); a subclass of SGD was not looked at at all
    results = run_on_ranks(2, on_ranks_optimizer_saved_by_rank_0, str(tmp_path / "opt.pt"), kind)
    assert results[0]["refused"] == "no error", results
    assert "state 'momentum_buffer' of parameter '0.lin.weight' is rank 0's shard" in results[1]["refused"], results


FULL_STATE = Case("mlp", {"dim": 16, "depth": 2}, policy="Block", steps=4)


def train_resuming_from_a_plain_optimizer(case: Case, stage: int | None, load: str = "full") -> dict:
    """Two steps on the unwrapped model; its model and optimizer state_dict() are loaded into a
    fresh model (wrapped at ``stage``), which trains the remaining steps. ``load``: how the
    optimizer's state goes in ("torch": torch's load_state_dict, refused at the step; the full
    load follows)."""
    from parity import build_optimizer, loss_fn

    rank, world = (0, 1) if stage is None else (dist.get_rank(), dist.get_world_size())
    plain = build_model(case)
    opt = build_optimizer(case, plain)
    for step in range(2):
        loss_fn(case, plain, global_batch(case, step)).backward()
        opt.step()
        opt.zero_grad()
    saved = {"model": copy.deepcopy(plain.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    model = build_model(case)
    if stage is not None:
        from shardwrap import ShardedModule

        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage)
    model.load_state_dict(saved["model"])
    opt = build_optimizer(case, model)
    refused = ""
    if stage is None:
        opt.load_state_dict(saved["opt"])
    else:
        if load == "torch":
            opt.load_state_dict(saved["opt"])
            before = {k: v.clone() for k, v in model.full_state_dict(rank0_only=False).items()}
            loss_fn(case, model, {k: v.chunk(world)[rank] for k, v in global_batch(case, 2).items()}).backward()
            try:
                opt.step()
                refused = "no error"
            except RuntimeError as exc:
                refused = str(exc)
            after = model.full_state_dict(rank0_only=False)
            assert all(torch.equal(before[k], after[k]) for k in before), "the refused step changed parameters"
            opt.zero_grad()
        model.load_full_optim_state_dict(opt, saved["opt"])  # every rank passes it; rank 0's is used
    for step in range(2, case.steps):
        loss_fn(case, model, {k: v.chunk(world)[rank] for k, v in global_batch(case, step).items()}).backward()
        opt.step()
        opt.zero_grad()
    full = model.full_state_dict() if stage is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"full": full, "refused": refused}


def on_ranks_plain_optimizer_state(case: Case, stage: int) -> dict:
    return train_resuming_from_a_plain_optimizer(case, stage, load="torch")


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_plain_optimizers_state_loaded_with_torch_is_refused_at_the_step_and_loads_with_the_full_load(stage, optim):
    # torch's load_state_dict keeps the full tensors; the step then failed in torch's broadcasting
    # ("The size of tensor a (3) must match ...") after stepping the parameters before the first
    # mismatch, naming nothing
    c = case(FULL_STATE, optim=optim)
    expected = train_resuming_from_a_plain_optimizer(c, None)["full"]
    results = run_on_ranks(2, on_ranks_plain_optimizer_state, c, stage, timeout=60)
    key = "momentum_buffer" if optim == "sgd" else "exp_avg"
    for r in results:
        assert f"state '{key}' of parameter 'inp.weight' has the full parameter's shape (16, 16)" in r["refused"], r["refused"]
        assert "load_full_optim_state_dict" in r["refused"] and "Nothing was stepped" in r["refused"], r["refused"]
    for name, value in expected.items():
        assert_close_params(results[0]["full"][name], value, optim, c.steps, name)


def on_ranks_saved_by_one_rank(path: str) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block})
    rank = dist.get_rank()
    before = model.full_state_dict(rank0_only=False)
    full = model.full_state_dict()  # a collective: every rank calls it, rank 0 gets the tensors
    if rank == 0:  # the naive pattern, and accelerate's save_state with the model registered
        torch.save(model.state_dict(), f"{path}.shared")
        torch.save(full, f"{path}.full")
    torch.save(model.state_dict(), f"{path}.{rank}")  # each rank its own shards
    dist.barrier()
    try:
        model.load_state_dict(torch.load(f"{path}.shared", weights_only=True))
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    unchanged = all(torch.equal(v, before[k]) for k, v in model.full_state_dict(rank0_only=False).items())
    model.load_state_dict(torch.load(f"{path}.{rank}", weights_only=True))  # its own: fine
    model.load_state_dict(torch.load(f"{path}.full", weights_only=True))  # full tensors: fine
    model.load_state_dict(model.state_dict())  # in memory: fine
    same = all(torch.equal(v, before[k]) for k, v in model.full_state_dict(rank0_only=False).items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    osd = model.sharded_optim_state_dict(opt)
    if rank == 0:
        torch.save(osd, f"{path}.optim")
    dist.barrier()
    try:
        model.load_sharded_optim_state_dict(opt, torch.load(f"{path}.optim", weights_only=True))
        optim_refused = "no error"
    except ValueError as exc:
        optim_refused = str(exc)
    model.load_sharded_optim_state_dict(opt, osd)  # its own, in memory: fine
    # torch's own optimizer state dict: each rank's own file steps; rank 0's on every rank is refused
    # at the next step, on the ranks it does not belong to, before anything is stepped
    torch.save(opt.state_dict(), f"{path}.opt{rank}")
    if rank == 0:
        torch.save(opt.state_dict(), f"{path}.opt")
    dist.barrier()
    opt.load_state_dict(torch.load(f"{path}.opt{rank}", weights_only=True))
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.load_state_dict(torch.load(f"{path}.opt", weights_only=True))
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
        torch_refused = "no error"
    except RuntimeError as exc:
        torch_refused = str(exc)
    stepped = any(not torch.equal(p.detach().to_local(), params[n]) for n, p in model.named_parameters())
    return {"refused": refused, "unchanged": unchanged, "same": same, "optim_refused": optim_refused,
            "torch_refused": torch_refused, "stepped": stepped}


def test_a_sharded_state_dict_saved_by_one_rank_is_refused_on_every_rank(tmp_path):
    # rank 1 loaded rank 0's shards as its own, silently (fully_shard does the same); the pickled
    # mesh remembers the rank that saved it
    results = run_on_ranks(2, on_ranks_saved_by_one_rank, str(tmp_path / "sd.pt"))
    for r in results:
        assert "rank 0's shards, loaded on rank 1" in r["refused"] and "full_state_dict()" in r["refused"], r
        assert r["unchanged"] and r["same"], r
        assert "optimizer state dict's DTensors" in r["optim_refused"] and "rank 0's shards" in r["optim_refused"], r
    # torch's opt.load_state_dict is not ours: its step refuses on the rank whose state is not its own
    assert results[0]["torch_refused"] == "no error" and results[0]["stepped"], results[0]
    assert "is rank 0's shard" in results[1]["torch_refused"] and not results[1]["stepped"], results[1]


def test_overridden_module_methods_keep_torch_signatures():
    from shardwrap import ShardedModule

    for name in ("load_state_dict", "named_parameters", "named_buffers", "named_modules"):
        ours = list(inspect.signature(getattr(ShardedModule, name)).parameters)
        theirs = list(inspect.signature(getattr(nn.Module, name)).parameters)
        assert ours == theirs, (name, ours, theirs)


def on_ranks_load_by_keyword() -> bool:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(8, 2), auto_wrap_policy={models.Block})
    torch.manual_seed(1)
    other = models.mlp(8, 2)
    result = model.load_state_dict(state_dict=other.state_dict(), strict=True)
    full = model.full_state_dict(rank0_only=False)
    return not result.missing_keys and all(torch.equal(full[k], v) for k, v in other.state_dict().items())


def test_load_state_dict_by_keyword():
    assert all(run_on_ranks(2, on_ranks_load_by_keyword))


# ---- optimizer kernels that write the shards without a version bump ------------------------------


def on_ranks_stage1_kernels(kernel: str, optim: str) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=1)
    opt = _kernel_optimizer(model, kernel, optim)
    rank = dist.get_rank()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
        ((model(x.chunk(2)[rank]) - y.chunk(2)[rank]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict(rank0_only=False)


def _kernel_optimizer(model: torch.nn.Module, kernel: str, optim: str) -> torch.optim.Optimizer:
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[kernel]
    if optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **flags)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **flags)


@pytest.mark.parametrize(("kernel", "optim"), [
    ("foreach", "sgd"), ("foreach", "adamw"), ("fused", "adamw"), ("loop", "sgd"), ("loop", "adamw"),
])  # no fused SGD: torch's DTensor has no sharding rule for aten._fused_sgd_ (fully_shard neither)
def test_stage1_sees_every_optimizer_kernel_write_the_shards(kernel, optim):
    """Multi-tensor and fused kernels write DTensor parameters without bumping their version
    counters; stage 1 keeps the unsharded buffer across steps and must still gather again after
    every step, or it trains on the other ranks' old rows (sharded_module._mark_stepped_units)."""
    torch.manual_seed(0)
    reference = models.mlp()
    opt = _kernel_optimizer(reference, "loop", optim)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
        ((reference(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for got in run_on_ranks(2, on_ranks_stage1_kernels, kernel, optim):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kernel} {optim} '{name}': {m}")


def mean_teacher(student: nn.Module, teacher: nn.Module, rank: int | None, mark: bool) -> dict[str, float]:
    """A mean teacher (Mean Teacher, BYOL, DINO): the student trains on the teacher's outputs; after
    each step the frozen teacher moves toward it with ``torch._foreach_lerp_``, which bumps no
    version counter on DTensor parameters. Returns the teacher's outputs on a fixed batch."""
    opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
    teacher.requires_grad_(False)
    outputs = {}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)
        x = x if rank is None else x.chunk(2)[rank]
        with torch.no_grad():
            target = teacher(x)
        ((student(x) - target) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(list(teacher.parameters()), list(student.parameters()), 0.3)
        if mark:
            teacher.mark_written()  # type: ignore[operator]
        with torch.no_grad():
            outputs[str(step)] = teacher(torch.ones(2, 16)).sum().item()
    return outputs


def on_ranks_mean_teacher(mark: bool) -> dict[str, float]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    student = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=1)
    torch.manual_seed(1)
    teacher = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=1)
    return mean_teacher(student, teacher, dist.get_rank(), mark)


@pytest.mark.parametrize("mark", [True, False])
def test_stage1_mark_written_after_a_foreach_write_outside_the_optimizer(mark):
    # torch._foreach_lerp_ into a wrapped teacher's parameters moves no version counter. Until
    # stop 42 the teacher then kept computing with its old rows unless mark_written() was called;
    # on a CPU stage 1 now finds the write by the shard's digest, so the teacher's outputs are
    # the unwrapped one's either way (mark_written() stays for a GPU).
    torch.manual_seed(0)
    student = models.mlp()
    torch.manual_seed(1)
    want = mean_teacher(student, models.mlp(), None, False)
    for got in run_on_ranks(2, on_ranks_mean_teacher, mark):
        assert got == pytest.approx(want, rel=1e-5), (got, want)


def data_write_after_wrapping(rank: int | None, stage: int) -> dict:
    """Halve every parameter through ``p.data`` right after wrapping (an init applied to the
    wrapped model, HF style: ``module.weight.data.normal_()``), then train two SGD steps. Returns
    the first loss and the full state dict."""
    torch.manual_seed(0)
    model = models.mlp()
    if rank is not None:
        from shardwrap import ShardedModule

        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage)
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(2):
        batch = global_batch(Case("mlp"), step)
        batch = batch if rank is None else {k: v.chunk(2)[rank] for k, v in batch.items()}
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = model.full_state_dict(rank0_only=False) if rank is not None else model.state_dict()
    return {"losses": losses, "full": {k: v.detach().clone() for k, v in full.items()}}


def on_ranks_data_write(stage: int) -> dict:
    return data_write_after_wrapping(dist.get_rank(), stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_write_through_p_data_right_after_wrapping_reaches_training(stage):
    # Stage 1 keeps each unit gathered: a write through p.data bumps no version counter it can
    # read, so the first forward used the other ranks' old rows (5.7e-1 off, silent) until the
    # first forward was made to gather.
    want = data_write_after_wrapping(None, stage)
    results = run_on_ranks(2, on_ranks_data_write, stage)
    first = sum(r["losses"][0] for r in results) / 2
    assert first == pytest.approx(want["losses"][0], rel=1e-5), (first, want["losses"])
    for r in results:
        for name, value in want["full"].items():
            torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} '{name}': {m}")


# ---- p.register_post_accumulate_grad_hook: an optimizer that steps inside backward ----------------


class DeadBlock(models.Block):
    """A Block with a parameter no forward uses: autograd never accumulates into it, so its hook
    must not run (and its optimizer never steps it)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.dead = nn.Linear(dim, dim)
        self.use_dead = False  # a step that sets it reaches ``dead`` after all

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.dead(x) if self.use_dead else y


def dead_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), DeadBlock(16), DeadBlock(16), nn.Linear(16, 5))


def step_in_backward(model: nn.Module, optim: str) -> dict[str, int]:
    """One optimizer per parameter, stepped and zeroed by the parameter's post-accumulate-grad hook
    (torch's "optimizer in backward" recipe); returns the calls per parameter name."""
    calls = {n: 0 for n, _ in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p in model.parameters():
        if optim == "sgd":
            opt = torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=0.01)
        else:
            opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1 if p.dim() >= 2 else 0.0)

        def hook(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
            calls[names[param]] += 1
            opt.step()
            opt.zero_grad()

        p.register_post_accumulate_grad_hook(hook)
    return calls


def in_backward_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)


def train_in_backward(model: nn.Module, optim: str, chunk: tuple[int, int] = (1, 0)) -> dict[str, int]:
    calls = step_in_backward(model, optim)
    for step in range(3):
        x, y = (t.chunk(chunk[0])[chunk[1]] for t in in_backward_batch(step))
        ((model(x) - y) ** 2).mean().backward()
    return calls


def on_ranks_in_backward(stage: int, optim: str) -> dict:
    from shardwrap import ShardedModule

    model = ShardedModule(dead_net(), auto_wrap_policy={DeadBlock}, stage=stage)
    calls = train_in_backward(model, optim, (dist.get_world_size(), dist.get_rank()))
    return {"full": model.full_state_dict(rank0_only=False), "calls": calls, "grads": [p.grad is None for p in model.parameters()]}


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_post_accumulate_grad_hooks_step_an_optimizer_in_backward_like_one_process(stage, optim):
    # Each parameter's hook runs once a backward with its reduced gradient, as autograd runs it
    # once p.grad is final; the unused ``dead`` parameters' never run. The per-parameter
    # optimizers then follow the unwrapped model's trajectory (fully_shard does the same).
    reference = dead_net()
    expected_calls = train_in_backward(reference, optim)
    assert expected_calls["1.dead.weight"] == 0 and expected_calls["0.weight"] == 3
    for r in run_on_ranks(2, on_ranks_in_backward, stage, optim):
        assert r["calls"] == expected_calls, r["calls"]
        assert all(r["grads"]), "every hook zeroed its gradient"
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- torch.save and copy.deepcopy of the sharded state dict, per rank ------------------------------------------------


def on_ranks_torch_save(case: Case, path: str, steps: int) -> dict:
    model, opt = make(case)
    train(case, model, opt, range(steps))
    mine = f"{path}.rank{dist.get_rank()}"
    # DTensors whose local tensors sit inside a unit's flat shard, at a storage offset
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "params": [p.detach() for p in model.parameters()]}, mine)
    dist.barrier()
    state = torch.load(mine, weights_only=True)
    loaded_params = all(
        isinstance(q, DTensor) and q.placements == p.placements and torch.equal(q.to_local(), p.to_local())
        for p, q in zip(model.parameters(), state["params"])
    )
    # a "best so far" copy in memory, as training scripts keep one: equal, and not the model's storage
    kept = copy.deepcopy(model.state_dict())
    deepcopied = all(
        isinstance(kept[k], DTensor) and kept[k].placements == v.placements and torch.equal(kept[k].to_local(), v.to_local())
        and kept[k].to_local().untyped_storage().data_ptr() != v.to_local().untyped_storage().data_ptr()
        for k, v in model.state_dict().items()
    )
    fresh, fresh_opt = make(case)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    train(case, fresh, fresh_opt, range(steps, case.steps))
    return {"full": fresh.full_state_dict(), **placed_params(case, fresh), "losses": [0.0] * case.steps, "norms": [],
            "loaded_params": loaded_params, "deepcopied": deepcopied}


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 3])
def test_torch_save_of_the_sharded_state_dict_per_rank_resumes_on_the_same_trajectory(stage, optim, tmp_path):
    # What fully_shard users do without DCP: each rank torch.saves model.state_dict() and
    # opt.state_dict(), loads them (weights_only) into a fresh wrapped model and goes on.
    run = case(stage=stage, optim=optim, steps=4)
    expected, _, _ = train_reference(run)
    results = run_on_ranks(2, on_ranks_torch_save, run, str(tmp_path / "sd.pt"), 2)
    assert all(r["loaded_params"] and r["deepcopied"] for r in results)
    compare(run, 2, results, reference=(expected, [], []))


def count_only(model: nn.Module) -> dict[str, int]:
    calls = {n: 0 for n, _ in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: calls.__setitem__(names[param], calls[names[param]] + 1))
    return calls


def accumulate_with_dead_once(model: nn.Module, chunk: tuple[int, int] = (1, 0)) -> dict[str, int]:
    """Two backward passes into the same grads (no zero_grad); only the first reaches ``dead``."""
    calls = count_only(model)
    for step in range(2):
        for block in model.modules():
            if isinstance(block, DeadBlock):
                block.use_dead = step == 0
        x, y = (t.chunk(chunk[0])[chunk[1]] for t in in_backward_batch(step))
        ((model(x) - y) ** 2).mean().backward()
    return calls


def on_ranks_dead_once(stage: int) -> dict:
    from shardwrap import ShardedModule

    model = ShardedModule(dead_net(), auto_wrap_policy={DeadBlock}, stage=stage)
    calls = accumulate_with_dead_once(model, (dist.get_world_size(), dist.get_rank()))
    return {"calls": calls, "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 3])
def test_post_accumulate_grad_hooks_skip_a_parameter_the_backward_did_not_reach(stage):
    # ``dead`` already holds a gradient from the first backward; the second reduction adds its
    # zeros to it, but autograd would not run its hook then, so shardwrap does not either.
    reference = dead_net()
    expected = accumulate_with_dead_once(reference)
    assert expected["1.dead.weight"] == 1 and expected["1.up.weight"] == 2
    for r in run_on_ranks(2, on_ranks_dead_once, stage):
        assert r["calls"] == expected, r["calls"]
        for name, p in reference.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def on_ranks_hooks_before_wrapping() -> list[str]:
    import warnings

    from shardwrap import ShardedModule

    model = dead_net()
    model[0].weight.register_hook(lambda g: g)
    model[1].up.weight.register_post_accumulate_grad_hook(lambda p: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ShardedModule(model, auto_wrap_policy={nn.Linear}, stage=3)
        ShardedModule(dead_net(), auto_wrap_policy={nn.Linear}, stage=3)  # no hooks: no warning
    return [str(w.message) for w in caught if "hooks registered before wrapping" in str(w.message)]


def test_gradient_hooks_on_the_original_parameters_are_named_in_a_warning():
    # They never run once the parameters are replaced by sharded ones (as under fully_shard): a
    # silent gap before; now each rank warns at wrap time, naming them.
    for messages in run_on_ranks(2, on_ranks_hooks_before_wrapping):
        assert len(messages) == 1, messages
        assert "'0.weight'" in messages[0] and "'1.up.weight'" in messages[0] and "after wrapping" in messages[0], messages


# ---- a double backward (create_graph=True): a gradient penalty ------------------------------------


def penalty_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's shape: the loss plus the squared distance of the input gradient's norm from 1."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return ((out - y) ** 2).mean() + ((g.norm(dim=1) - 1) ** 2).mean()


def plain_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def train_penalized(model: nn.Module, loss_fn, chunk: tuple[int, int] = (1, 0), steps: range = range(3),
                    opt: torch.optim.Optimizer | None = None) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in steps:
        x, y = (t.chunk(chunk[0])[chunk[1]] for t in in_backward_batch(step))
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def on_ranks_double_backward(stage: int) -> dict:
    import warnings

    from shardwrap import ShardedModule

    model = ShardedModule(dead_net(), auto_wrap_policy={DeadBlock}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # built before the refusal, as in a training script
    chunk = (dist.get_world_size(), dist.get_rank())
    x, y = (t.chunk(chunk[0])[chunk[1]] for t in in_backward_batch(0))
    if stage == 1:
        try:  # second derivatives over the parameters (AdaHessian's form): refused, and training goes on
            plain_loss(model, x, y).backward(create_graph=True)
            error = ""
        except RuntimeError as e:
            error = str(e)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_penalized(model, penalty_loss, chunk, opt=opt)
        return {"full": model.full_state_dict(rank0_only=False), "error": error}
    try:
        penalty_loss(model, x, y)
        error = ""
    except RuntimeError as e:
        error = str(e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the next forward cleans up after the refused backward
        train_penalized(model, plain_loss, chunk, opt=opt)
    return {"full": model.full_state_dict(rank0_only=False), "error": error}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_double_backward_trains_like_one_process_at_stage_1_and_is_refused_clearly_at_2_and_3(stage):
    # Stage 1 keeps the gathered parameters, so the graph create_graph=True builds stays valid and
    # a gradient penalty trains like one process (second derivatives over the parameters themselves,
    # loss.backward(create_graph=True), are refused there, naming what works, and training goes on). Stages 2 and 3 free them when the backward ends:
    # the first backward raises on every rank, naming the unit and what to do (fully_shard fails
    # later with torch's "setStorage ... out of bounds"), and the model then trains on as if the
    # refused step had not happened.
    reference = dead_net()
    train_penalized(reference, penalty_loss if stage == 1 else plain_loss)
    for r in run_on_ranks(2, on_ranks_double_backward, stage):
        if stage > 1:
            assert "create_graph=True" in r["error"] and "stage=1" in r["error"] and "unit '" in r["error"], r["error"]
        else:
            assert "requires grad" in r["error"] and "torch.autograd.grad(out, x" in r["error"], r["error"]
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def refused_then_trained(model: nn.Module, rank: int | None) -> dict[str, torch.Tensor]:
    """Stage 1's refused ``loss.backward(create_graph=True)``, then ``opt.zero_grad()`` and two
    plain steps (SGD with momentum); the unwrapped model takes the two steps only."""
    import warnings

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    local = [b if rank is None else b.chunk(2)[rank] for b in batches]
    if rank is not None:
        with pytest.raises(RuntimeError, match="requires grad"):
            model(local[0]).pow(2).mean().backward(create_graph=True)
        opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the next forward cleans up after the refused backward
        for x in local[1:]:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()} if rank is None else model.full_state_dict(rank0_only=False)


def on_ranks_refused_then_trained() -> dict[str, torch.Tensor]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    return refused_then_trained(ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=1), dist.get_rank())


def test_a_refused_create_graph_backward_leaves_no_gradient_in_stage_1s_buffer():
    # Stage 1 keeps the unit's unsharded gradient buffer between steps; the refused gradient stayed
    # in it and was added to the next step's (1.5e-2 off after one step in the audit's probe;
    # fully_shard is exact there)
    torch.manual_seed(0)
    want = refused_then_trained(models.mlp(), None)
    for got in run_on_ranks(2, on_ranks_refused_then_trained):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- code that walks the module tree child by child (Hugging Face's weight-decay groups) ----------


def hf_parameter_names(model: nn.Module, forbidden: tuple[type, ...] = (nn.LayerNorm,)) -> list[str]:
    """Hugging Face's ``get_parameter_names`` (how its Trainer picks the parameters that get weight
    decay): a walk over ``named_children()``, skipping norms and biases."""
    result = []
    for name, child in model.named_children():
        result += [
            f"{name}.{n}" for n in hf_parameter_names(child, forbidden)
            if not isinstance(child, forbidden) and "bias" not in f"{name}.{n}" and "layernorm" not in f"{name}.{n}".lower()
        ]
    return result + [k for k in model._parameters if "bias" not in k]


def train_hf_groups(model: nn.Module, optim: str, chunk: tuple[int, int] = (1, 0)) -> list[str]:
    decay = set(hf_parameter_names(model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.5},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0, "lr": 0.02},
    ]
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(groups, lr=0.01)
    model.train()
    for step in range(3):
        batch = {k: v.chunk(chunk[0])[chunk[1]] for k, v in global_batch(GPT2, step).items()}
        model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()
    return sorted(decay)


def on_ranks_hf_groups(stage: int, optim: str) -> dict:
    from shardwrap import ShardedModule

    model = ShardedModule(build_model(GPT2), auto_wrap_policy={models.gpt2_block_class()}, stage=stage)
    model.eval()
    flags = [model.module.training, *(m.training for m in model.modules())]
    seen: list[nn.Module] = []
    model.apply(seen.append)
    head = model.module.lm_head
    model.lm_head = head  # a top-level child, as named_children names it: set on the wrapped model
    replaced_inside = "lm_head" not in model._modules and model.module.lm_head is head
    decay = train_hf_groups(model, optim, (dist.get_world_size(), dist.get_rank()))
    return {
        "full": model.full_state_dict(rank0_only=False), "decay": decay, "eval_everywhere": not any(flags),
        "train_everywhere": all(m.training for m in model.modules()), "applied_to_model": sum(m is model.module for m in seen) == 1 and not any(m is model for m in seen),
        "replaced_inside": replaced_inside,
    }


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 3])
def test_hugging_face_weight_decay_groups_match_the_unwrapped_model(stage, optim):
    # Hugging Face's Trainer names the decayed parameters by walking named_children(); the names
    # must be named_parameters()' (they were 'module.'-prefixed: no parameter got weight decay,
    # a silent 6e-3 after three steps). train(), eval(), apply() and assigning a top-level child
    # reach the wrapped model.
    reference = build_model(GPT2)
    want = train_hf_groups(reference, optim)
    assert len(want) > 4
    for r in run_on_ranks(2, on_ranks_hf_groups, stage, optim):
        assert r["decay"] == want
        assert r["eval_everywhere"] and r["train_everywhere"] and r["applied_to_model"] and r["replaced_inside"], r
        for name, value in reference.state_dict().items():
            assert_close_params(r["full"][name], value, optim, 3, name)


class Flagged(nn.Module):
    """A forward that reads plain attributes a training loop sets: a temperature and a branch flag."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.use_extra = 1.0, True
        self.body, self.extra = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) * self.scale
        return self.extra(h) if self.use_extra else h


def train_flagged(model: nn.Module, optim: str, chunk: tuple[int, int] = (1, 0)) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(4):
        if step == 1:
            model.scale = 0.25  # written on the wrapper: the forward must see it
        if step == 2:
            model.use_extra = False
        if step == 3:
            del model.scale, model.use_extra
            model.scale, model.use_extra = 2.0, True
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).chunk(chunk[0])[chunk[1]]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def on_ranks_flagged(stage: int, optim: str) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(Flagged(), auto_wrap_policy={nn.Linear}, stage=stage)
    train_flagged(model, optim, (dist.get_world_size(), dist.get_rank()))
    model.note = "kept"  # a new name goes to the model too, as it would under fully_shard
    return {
        "full": model.full_state_dict(rank0_only=False), "on_model": (model.module.scale, model.module.note),
        "not_on_wrapper": not {"scale", "use_extra", "note"} & set(model.__dict__), "stage_kept": model.stage is not None,
    }


def on_ranks_attribute_edges() -> dict:
    from shardwrap import ShardedModule

    class Tuned(ShardedModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__(model, auto_wrap_policy={nn.Linear}, stage=3)
            self.scale = 3.0  # the subclass's own setting: not the model's scale
            self.calls = 0

        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    sub = Tuned(Flagged())
    x = torch.ones(2, 6)
    sub.use_extra = False  # after the subclass's __init__: the model's flag
    out = {"subclass_kept": (sub.scale, sub.module.scale, "scale" in sub.__dict__), "sub_forward": (sub(x).shape[0], sub.calls),
           "sub_routes": sub.module.use_extra is False and "use_extra" not in sub.__dict__}
    model = ShardedModule(Flagged(), auto_wrap_policy={nn.Linear}, stage=3)
    model.register_buffer("seen", torch.zeros(1))  # registered on the wrapper: stays there
    model.seen = torch.ones(1)
    out["buffer_on_wrapper"] = (model.seen.item(), hasattr(model.module, "seen"))
    model.training = False  # the model's own flag, as a plain model's root gets it
    out["training"] = (model.training, model.module.training)
    model.train()
    refusals = []
    for name, value in (("p", nn.Parameter(torch.ones(2))), ("head", nn.Linear(6, 1)), ("body", nn.Linear(6, 6))):
        try:
            setattr(model, name, value)
            refusals.append(None)
        except ValueError as exc:
            refusals.append(str(exc))
    out["refusals"] = refusals
    out["unchanged"] = not hasattr(model.module, "p") and not hasattr(model.module, "head") and isinstance(model.module.body, nn.Linear)
    model.extra = nn.Identity()  # no parameters: attached
    model.body = model.module.body  # its own parameters: attached
    out["attached"] = isinstance(model.module.extra, nn.Identity)
    return out


def test_attribute_writes_keep_what_the_wrapper_owns_and_refuse_parameters_no_unit_shards():
    # A parameter attached after wrapping would train unsynchronized on each rank (a review found
    # it once writes went to the model); a subclass's own settings and a buffer registered on the
    # wrapper stay on it; `training` reaches the model's root, as on a plain model.
    for r in run_on_ranks(2, on_ranks_attribute_edges):
        assert r["subclass_kept"] == (3.0, 1.0, True) and r["sub_forward"] == (2, 1) and r["sub_routes"], r
        assert r["buffer_on_wrapper"] == (1.0, False) and r["training"] == (False, False), r
        assert all(m and "after wrapping" in m and "before wrapping it" in m for m in r["refusals"]), r["refusals"]
        assert "'p'" in r["refusals"][0] and "'head.weight'" in r["refusals"][1] and "'body.bias'" in r["refusals"][2]
        assert r["unchanged"] and r["attached"], r


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_attributes_set_on_the_wrapper_reach_the_models_forward(stage, optim):
    # They stayed on the wrapper, shadowing the model's own (a read even gave the new value back),
    # while the forward went on with the old one: a silent wrong loss from the step it was set.
    torch.manual_seed(0)
    reference = Flagged()
    train_flagged(reference, optim)
    for r in run_on_ranks(2, on_ranks_flagged, stage, optim):
        assert r["on_model"] == (2.0, "kept") and r["not_on_wrapper"] and r["stage_kept"], r
        for name, value in reference.state_dict().items():
            assert_close_params(r["full"][name], value, optim, 4, name)


# ---- Hugging Face generate ---------------------------------------------------------------------


def prompts_and_eos(world: int) -> tuple[torch.Tensor, int]:
    """A prompt per rank, and an end-of-sequence token rank 0's greedy continuation reaches at
    once while the others' never do (so the ranks' generations take different numbers of steps)."""
    reference = build_model(GPT2).eval()
    prompts = torch.randint(0, 96, (world, 1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs = [reference.generate(prompts[r], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 6:].tolist() for r in range(world)]
    eos = next(t for t in outs[0] if all(t not in out for out in outs[1:]))
    return prompts, eos


def on_ranks_generate_with_eos(stage: int) -> dict:
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    prompts, eos = prompts_and_eos(world)
    model = ShardedModule(build_model(GPT2), auto_wrap_policy={models.gpt2_block_class()}, stage=stage)
    model.eval()
    with torch.no_grad():
        ids = model.generate(prompts[rank], max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos)
    model.train()
    model(input_ids=prompts[rank], labels=prompts[rank]).loss.backward()  # and training goes on
    try:
        model.resize_token_embeddings(100)
        resize = "no error"
    except RuntimeError as exc:
        resize = str(exc)
    return {"ids": ids[0].tolist(), "resize": resize, "vocab": model.get_input_embeddings().weight.shape[0]}


@pytest.mark.parametrize("stage", [2, 3])
def test_generate_stops_at_a_different_step_on_each_rank(stage):
    # Rank 0 reaches its end-of-sequence token first. transformers keeps every rank calling forward
    # until all are done (synced_gpus) by itself for fully_shard and ZeRO-3; on a ShardedModule,
    # wrapping makes synced_gpus default to True. Without it rank 0 stopped calling forward and the
    # next gathers found the ranks out of step.
    world = 2
    prompts, eos = prompts_and_eos(world)
    reference = build_model(GPT2).eval()
    results = run_on_ranks(world, on_ranks_generate_with_eos, stage)
    for rank, r in enumerate(results):
        with torch.no_grad():
            want = reference.generate(prompts[rank], max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos)
        assert r["ids"] == want[0].tolist(), (rank, r["ids"], want[0].tolist())
    assert len(results[0]["ids"]) < len(results[1]["ids"]) == 12  # rank 0 did stop early
    for r in results:  # resizing after wrapping is refused, saying to resize first (it failed in DTensor)
        assert "Resize before wrapping" in r["resize"] and r["vocab"] == 96, r


class SyncFlagged(Flagged):
    """A model with attributes under names the wrapper uses too (a flag called ``sync``, a ``stage``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sync, self.stage = True, "pretrain"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1.0 if self.sync else 0.5)


def train_sync_flagged(model: nn.Module, chunk: tuple[int, int] = (1, 0)) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        if step == 1:
            model.sync = False  # the model's flag: the wrapper's own state is private and keeps reducing
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).chunk(chunk[0])[chunk[1]]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def on_ranks_sync_flagged(stage: int) -> dict:
    import warnings

    from shardwrap import ShardedModule

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ShardedModule(SyncFlagged(), auto_wrap_policy={nn.Linear}, stage=stage)
    train_sync_flagged(model, (dist.get_world_size(), dist.get_rank()))
    return {"full": model.full_state_dict(rank0_only=False), "warned": [str(w.message) for w in caught if "holds" in str(w.message)],
            "inner_sync": model.module.sync}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_models_attribute_named_like_the_wrappers_state_is_the_models(stage):
    # `model.sync = False` on a model with its own `sync` flag turned the wrapper's gradient
    # averaging off (a silent wrong number, found in review); the wrapper's state is private now.
    # A name it still holds (`stage`) draws a warning at wrap time.
    torch.manual_seed(0)
    reference = SyncFlagged()
    train_sync_flagged(reference)
    for r in run_on_ranks(2, on_ranks_sync_flagged, stage):
        assert r["inner_sync"] is False, r
        assert len(r["warned"]) == 1 and "'stage'" in r["warned"][0] and "'sync'" not in r["warned"][0], r["warned"]
        for name, value in reference.state_dict().items():
            assert_close_params(r["full"][name], value, "sgd", 3, name)


def on_ranks_backward_inputs(stage: int) -> dict:
    import warnings

    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 16).chunk(world)[rank]
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).pow(2).mean().backward()  # an ordinary step: no warning
        opt.step()
        opt.zero_grad()
        out["ordinary"] = [str(w.message) for w in caught if "has a gradient" in str(w.message)]
        model(x).pow(2).mean().backward(inputs=list(model.parameters()))
        out["grads"] = [p.grad is None for p in model.parameters()]
        opt.step()
        out["inputs"] = [str(w.message) for w in caught if "has a gradient" in str(w.message)]
        opt.zero_grad()
        # no warning where the step is no no-op: a closure that runs its own backward after a
        # forward that got none, and a head trained on a wrapped encoder's detached output
        model(x)
        opt.step(lambda: model(x).pow(2).mean().backward())
        head = torch.nn.Linear(5, 1)
        probe = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.1)
        for _ in range(2):
            head(model(x).detach()).pow(2).mean().backward()
            probe.step()
            probe.zero_grad()
        out["ordinary_after"] = [str(w.message) for w in caught if "has a gradient" in str(w.message)][1:]
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_backward_with_the_parameters_as_inputs_reaches_none_and_the_step_warns(stage):
    # loss.backward(inputs=list(model.parameters())) computed nothing for them and the step changed
    # nothing, silently (fully_shard alike): the shards are not leaves of the forward's graph
    for r in run_on_ranks(2, on_ranks_backward_inputs, stage):
        assert r["ordinary"] == [], r
        assert all(r["grads"]), r  # what makes the warning necessary: nothing reached them
        assert len(r["inputs"]) == 1 and "loss.backward(inputs=...)" in r["inputs"][0], r
        assert r["ordinary_after"] == [], r  # a review: both warned


class FullMomentum(torch.optim.Optimizer):
    """Momentum of the full gradient, kept as a plain tensor of the parameter's shape (as optimizers
    that need the whole matrix keep it on DTensor parameters)."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import distribute_tensor

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                buf = self.state[p].setdefault("buf", torch.zeros_like(grad))
                buf.mul_(group["momentum"]).add_(grad)
                p.add_(distribute_tensor(buf, p.device_mesh, p.placements) if isinstance(p, DTensor) else buf, alpha=-group["lr"])


def train_full_momentum(stage: int | None) -> dict:
    c = case(MLP, steps=3)
    rank, world = (0, 1) if stage is None else (dist.get_rank(), dist.get_world_size())
    model = build_model(c)
    if stage is not None:
        from shardwrap import ShardedModule

        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage)
    opt = FullMomentum(model.parameters())
    from parity import loss_fn

    for step in range(c.steps):
        loss_fn(c, model, {k: v.chunk(world)[rank] for k, v in global_batch(c, step).items()}).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict() if stage is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}


def on_ranks_full_momentum(stage: int) -> dict:
    return train_full_momentum(stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_keeping_full_state_of_its_own_is_not_taken_for_a_loaded_one(stage):
    # a review: the refusal of full-shaped state loaded into torch's optimizers caught this one too
    expected = train_full_momentum(None)
    full = run_on_ranks(2, on_ranks_full_momentum, stage)[0]
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- parametrizations ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "spectral_norm"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_parametrized_weights_train_like_one_process(kind, stage, optim):
    """torch's parametrizations (``torch.nn.utils.parametrizations``) registered before wrapping:
    the units shard the parametrization's own parameters (``original``, ``original0``/``1``), the
    weight is computed from the gathered ones at every forward, and training equals one process."""
    from parity import Case, check_parity

    check_parity(Case("parametrized_mlp", {"kind": kind}, policy="Block", optim=optim, stage=stage), 2)


def t5_prompts_and_eos(world: int) -> tuple[torch.Tensor, int]:
    """As ``prompts_and_eos``, for the T5 of ``models.t5``: rank 0's continuation ends at once."""
    torch.manual_seed(0)
    reference = models.t5().eval()
    prompts = torch.randint(3, 128, (world, 1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs = [reference.generate(input_ids=prompts[r], max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 1:].tolist() for r in range(world)]
    eos = next(t for t in outs[0] if all(t not in out for out in outs[1:]))
    return prompts, eos


def on_ranks_t5_generate(stage: int, how: str) -> dict:
    from torch.distributed.fsdp import register_fsdp_forward_method

    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    prompts, eos = t5_prompts_and_eos(world)
    torch.manual_seed(0)
    model = ShardedModule(models.t5(), auto_wrap_policy={models.t5_block_class()}, stage=stage)
    if how == "registered":
        model.register_forward_method("generate")
    elif how == "torch's register_fsdp_forward_method":
        register_fsdp_forward_method(model, "generate")
    model.eval()
    with torch.no_grad():
        ids = model.generate(input_ids=prompts[rank], max_new_tokens=6, do_sample=False, eos_token_id=eos)
    model.train()
    model(input_ids=prompts[rank], labels=prompts[rank]).loss.backward()  # and training goes on
    return {"ids": ids[0].tolist()}


@pytest.mark.parametrize("how", ["as wrapped", "registered", "torch's register_fsdp_forward_method"])
@pytest.mark.parametrize("stage", [1, 3])
def test_an_encoder_decoders_generate_matches_the_unwrapped_model_however_it_is_registered(stage, how):
    # T5's generate calls its encoder directly (get_encoder()(...)), outside forward: it failed
    # with "mixed torch.Tensor and DTensor" (as under fully_shard, unregistered). Registered with
    # model.register_forward_method("generate"), it lost the synced_gpus default, and at stage 3
    # rank 1 died when rank 0 stopped early; torch's register_fsdp_forward_method reached
    # fully_shard's internal state. Now generate is its unit's forward method from wrapping on.
    world = 2
    prompts, eos = t5_prompts_and_eos(world)
    torch.manual_seed(0)
    reference = models.t5().eval()
    results = run_on_ranks(world, on_ranks_t5_generate, stage, how)
    for rank, r in enumerate(results):
        with torch.no_grad():
            want = reference.generate(input_ids=prompts[rank], max_new_tokens=6, do_sample=False, eos_token_id=eos)
        assert r["ids"] == want[0].tolist(), (rank, r["ids"], want[0].tolist())
    assert len(results[0]["ids"]) < len(results[1]["ids"])  # rank 0 did stop early
