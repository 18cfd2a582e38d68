"""A load that fails changes nothing, on every rank: in-memory state dicts (design/notes/state-dicts.md)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from harness import run_on_ranks
from parity import Case, build_model, resolve_policy

LIVE = Case("mlp", {"dim": 16, "depth": 2}, policy="Block", optim="adamw")


# ---- helpers: models, optimizers, snapshots ------------------------------------------------------


def wrap(case: Case):
    from shardwrap import ShardedModule

    return ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case))


def optimizer_for(model, grouping: str) -> torch.optim.Optimizer:
    """AdamW with the parameters grouped ``by_dim`` (nanoGPT's decay split), all in ``one`` group,
    or with the norm weights moved into the first group (``norms_first``)."""
    named = list(model.named_parameters())
    if grouping == "one":
        return torch.optim.AdamW([p for _, p in named], lr=1e-2)
    first = (lambda n, p: p.dim() >= 2) if grouping == "by_dim" else (lambda n, p: p.dim() >= 2 or "norm.weight" in n)
    groups = [
        {"params": [p for n, p in named if first(n, p)], "weight_decay": 0.1},
        {"params": [p for n, p in named if not first(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def plain_group_names(case: Case, grouping: str) -> list[list[str]]:
    """The same grouping on the unwrapped model (same names and dims), by name."""
    model = build_model(case)
    ids = {id(p): n for n, p in model.named_parameters()}
    return [[ids[id(p)] for p in g["params"]] for g in optimizer_for(model, grouping).param_groups]


def fake_step(model, opt, value: float = 1.0) -> None:
    """One optimizer step with every gradient set to ``value``: creates state, moves parameters."""
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    opt.step()
    opt.zero_grad()


def snapshot(model, opt) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "optim": copy.deepcopy(opt.state_dict()) if opt is not None else None,
    }


def same_bits(a, b) -> bool:
    """Equal down to the bits (NaNs included): tensors by their bytes, containers recursively."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def attempt(action) -> str:
    try:
        action()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_same_bits_oracle_can_fail():
    a = {"w": torch.tensor([1.0, float("nan")]), "s": [torch.tensor(2.0)]}
    b = copy.deepcopy(a)
    assert same_bits(a, b)
    b["w"][0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not same_bits(a, b)
    c = copy.deepcopy(a)
    c["s"][0] = torch.tensor(2.0, dtype=torch.float64)
    assert not same_bits(a, c)


# ---- a failed load changes nothing ----------------------------------------------------------------


def on_ranks_disagreeing_load_state_dict() -> dict:
    model = wrap(LIVE)
    other = wrap(Case(**{**LIVE.__dict__, "seed": 5}))
    sd = dict(other.state_dict())
    if dist.get_rank() == 1:  # only this rank's dict is bad
        sd["head.weight"] = torch.zeros(3, 3)
    before = snapshot(model, None)
    message = attempt(lambda: model.load_state_dict(sd))
    return {"message": message, "unchanged": same_bits(before, snapshot(model, None))}


def test_load_state_dict_refused_on_one_rank_is_refused_on_all():
    results = run_on_ranks(2, on_ranks_disagreeing_load_state_dict)
    for r in results:
        assert "rank 1: shape mismatch for 'head.weight': checkpoint (3, 3) vs model (5, 16)" in r["message"], r["message"]
        assert r["unchanged"], "a rank loaded while another refused"


def on_ranks_non_strict(sd: dict) -> dict:
    model = wrap(LIVE)
    result = model.load_full_state_dict(sd if dist.get_rank() == 0 else {}, strict=False)
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys), "full": model.full_state_dict(rank0_only=False)}


def test_load_full_state_dict_non_strict_reports_keys_as_torch_does():
    source = build_model(Case(**{**LIVE.__dict__, "seed": 6})).state_dict()
    sd = {k: v for k, v in source.items() if not k.startswith("blocks.1.")}
    sd["extra.weight"] = torch.ones(2)
    plain = build_model(LIVE)  # the same initial values as the ranks' model
    expected = plain.load_state_dict(sd, strict=False)
    assert expected.missing_keys and expected.unexpected_keys
    for r in run_on_ranks(2, on_ranks_non_strict, sd):
        assert r["missing"] == expected.missing_keys and r["unexpected"] == expected.unexpected_keys
        for k, v in plain.state_dict().items():
            assert torch.equal(r["full"][k], v), k
