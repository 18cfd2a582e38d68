"""Ranks that disagree get a named Python error on every rank, never a signal, a hang or a
silent wrong number; an exception inside a step leaves the module usable
(design/notes/rank-agreement.md). Functions named ``on_ranks_*`` run on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import models
from torch.distributed.tensor import DTensor

from harness import run_on_ranks
from parity import Case, assert_close_params, build_model, build_optimizer, expected_chunk, global_batch


# ---- part 4: every rank wraps the same model ------------------------------------------------


def rank_model(case: str) -> nn.Module:
    """A two-block MLP that differs on rank 1 as ``case`` says."""
    torch.manual_seed(0)
    model = models.mlp(16, 2)
    if dist.get_rank() != 1:
        return model
    block = model.blocks[1]
    if case == "shape":
        block.up = nn.Linear(16, 33)
    elif case == "transposed":  # same number of elements: would silently train another model
        block.up.weight = nn.Parameter(torch.randn(block.up.weight.shape[::-1]))
    elif case == "dtype":
        model.head.double()  # the root unit then mixes dtypes on rank 1 only: still the same error everywhere
    elif case == "requires_grad":
        block.up.bias.requires_grad_(False)
    elif case == "extra":
        block.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    return model


def on_ranks_wrap_different_models(case: str) -> str:
    from shardwrap import ShardedModule

    try:
        ShardedModule(rank_model(case), auto_wrap_policy={models.Block})
    except ValueError as exc:
        return str(exc)
    return "no error"


EXPECTED_DIFFERENCE = {
    "shape": ["'blocks.1.up.weight'", "(32, 16)", "(33, 16)"],
    "transposed": ["'blocks.1.up.weight'", "(32, 16)", "(16, 32)"],
    "dtype": ["'head.weight'", "float32", "float64"],
    "requires_grad": ["'blocks.1.up.bias'", "requires_grad=True", "requires_grad=False"],
    "extra": ["'blocks.1.extra'", "rank 0: no parameter 'blocks.1.extra'", "shape (3,)"],
}


@pytest.mark.parametrize("case", list(EXPECTED_DIFFERENCE))
def test_ranks_that_built_different_models_are_refused_on_every_rank(case):
    messages = run_on_ranks(2, on_ranks_wrap_different_models, case, timeout=30)
    assert messages[0] == messages[1], messages
    for fragment in ["ranks built different models", "rank 0:", "rank 1:", *EXPECTED_DIFFERENCE[case]]:
        assert fragment in messages[0], (case, fragment, messages[0])


def on_ranks_same_model_costs_one_collective() -> dict:
    from shardwrap import ShardedModule
    from shardwrap.collectives import count_collectives

    with count_collectives() as counted:
        ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block})
    return dict(counted)


def test_the_check_is_one_16_byte_collective():
    for counts in run_on_ranks(2, on_ranks_same_model_costs_one_collective):
        assert counts["ints_calls"] == 1 and counts["ints"] == 2, counts


# ---- part 5: an exception never leaves the module stuck -------------------------------------


class Boom(Exception):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise Boom("backward")


FAIL = {"kind": None}  # set by the training loop, read by the hook on blocks[1]


def failing_hook(module, args, output):  # type: ignore[no-untyped-def]
    if FAIL["kind"] == "forward":
        raise Boom("forward")
    if FAIL["kind"] == "backward":
        return _RaiseInBackward.apply(output)
    return output


def failing_step(model, batch, kind) -> bool:  # type: ignore[no-untyped-def]
    """One forward and backward that raise at ``kind`` (None: a normal step). True if it raised."""
    FAIL["kind"] = kind
    try:
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        if kind == "loss":
            raise Boom("loss")
        loss.backward()
    except Boom:
        return True
    finally:
        FAIL["kind"] = None
    return False


PLAN = {1: "forward", 2: "backward", 4: "loss", 5: "backward"}  # step -> where it raises
RECOVER = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", steps=7)


def on_ranks_recover_after_exceptions(stage: int) -> dict:
    import warnings

    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    plain = build_model(RECOVER)
    plain.blocks[1].register_forward_hook(failing_hook)
    model = ShardedModule(plain, auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(RECOVER, model)
    shown, saved = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(RECOVER.steps):
            batch = {k: v.chunk(world)[rank] for k, v in global_batch(RECOVER, step).items()}
            if not failing_step(model, batch, PLAN.get(step)):
                opt.step()
            else:
                # the sharded parameters, not the gathered views the failed step left in the slots
                # (a new optimizer over them raised torch's "can't optimize a non-leaf Tensor")
                shown.append(all(isinstance(p, DTensor) and p.is_leaf for p in model.parameters()))
                if step == 5:  # a save in the except block: refused on this rank, before any collective
                    try:
                        model.state_dict()
                        saved.append("no error")
                    except RuntimeError as exc:
                        saved.append(str(exc))
            opt.zero_grad()
    warned = [str(w.message) for w in caught if "raised before it finished" in str(w.message)]
    return {"full": model.full_state_dict(), "warned": warned, "shown": shown, "saved": saved}


def reference_skipping_failed_steps() -> dict:
    model = build_model(RECOVER)
    opt = build_optimizer(RECOVER, model)
    for step in range(RECOVER.steps):
        if step in PLAN:
            continue
        batch = global_batch(RECOVER, step)
        ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_that_raised_is_skipped_and_training_goes_on(stage):
    expected = reference_skipping_failed_steps()
    results = run_on_ranks(2, on_ranks_recover_after_exceptions, stage, timeout=60)
    full = results[0]["full"]
    assert set(full) == set(expected)
    for name, value in expected.items():
        assert_close_params(full[name], value, "sgd", RECOVER.steps, name)
    for r in results:  # the forward, the first backward, the second backward (the loss leaves nothing)
        assert r["shown"] == [True] * len(PLAN), r
        assert len(r["saved"]) == 1 and "raised before it finished" in r["saved"][0] and "next forward" in r["saved"][0], r
        assert len(r["warned"]) == 3, r["warned"]
        assert "previous forward" in r["warned"][0] and "previous backward" in r["warned"][1], r["warned"]


def on_ranks_save_after_one_rank_failed(path: str, how: str) -> dict:
    """Step 1 raises on rank 0 only (a bad sample); rank 0's except block saves, then goes on with
    step 2, while rank 1 finishes step 1."""
    import warnings

    from shardwrap import ShardedModule, save_checkpoint

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ShardedModule(models.mlp(8, 3), auto_wrap_policy={models.Block}, stage=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = [0]

    def bad_sample(module, args):  # type: ignore[no-untyped-def]
        if step[0] == 1 and rank == 0:
            raise Boom("forward")

    model.module.blocks[1].register_forward_pre_hook(bad_sample)
    out: dict = {"save": None, "errors": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step[0] in range(3):
            try:
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            except Boom:
                try:
                    save_checkpoint(path, model, opt) if how == "checkpoint" else model.full_state_dict()
                    out["save"] = "no error"
                except RuntimeError as exc:
                    out["save"] = str(exc)
            except Exception as exc:  # the ranks' next collectives no longer meet: a clear error, once
                out["errors"].append(str(exc))
                break
    return out


@pytest.mark.parametrize("how", ["checkpoint", "full_state_dict"])
def test_a_save_after_a_step_that_raised_on_one_rank_is_refused_before_any_collective(how, tmp_path):
    # rank 0's save issued collectives that met rank 1's, still inside the step: gloo aborted a
    # process (SIGABRT). Now the save refuses on rank 0 alone, and both ranks then get a clear error.
    results = run_on_ranks(2, on_ranks_save_after_one_rank_failed, str(tmp_path / "ck"), how, timeout=120)
    assert "raised before it finished" in results[0]["save"], results
    assert results[1]["save"] is None, results
    for r in results:
        assert len(r["errors"]) == 1 and ("ranks disagree" in r["errors"][0] or "went away" in r["errors"][0]), results


def on_ranks_hundred_failures(stage: int) -> dict:
    import warnings

    from shardwrap import ShardedModule
    from shardwrap.unit import DataState, GradState, TrainingState

    torch.manual_seed(0)
    plain = models.mlp(8, 3)
    plain.blocks[1].register_forward_hook(failing_hook)
    model = ShardedModule(plain, auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 5)}
    kinds = ["forward", "backward", "loss"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(100):
            failing_step(model, batch, kinds[i % 3])
            opt.zero_grad()
        ok = not failing_step(model, batch, None)  # the recovery runs in this forward
        opt.step()
        opt.zero_grad()
    settled_data = DataState.UNSHARDED if stage == 1 else DataState.SHARDED
    return {
        "ok": ok,
        "data": all(u.data_state in (settled_data, DataState.UNSHARDED_STALE) for u in model.units),
        "freed": stage == 1 or all(u.unsharded_buffer.untyped_storage().nbytes() == 0 for u in model.units),
        "grad": all(u.grad_state in (GradState.NONE, GradState.REDUCED) for u in model.units),
        "nothing_pending": all(u._packed is None and u._reduction is None and u._gather is None for u in model.units),
        "idle": model._state is TrainingState.IDLE and all(u.training_state is TrainingState.IDLE for u in model.units),
        "schedule_empty": not (model.schedule.pre_forward or model.schedule.post_forward or model.schedule._in_flight),
        "slots": all(isinstance(p, DTensor) for p in model.module.parameters()),
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_a_hundred_failed_steps_leave_nothing_behind(stage):
    for r in run_on_ranks(2, on_ranks_hundred_failures, stage, timeout=90):
        assert all(r.values()), r


WAITED: list[str] = []  # the injected collectives' waits, in order (per process)


class _LostPeer:
    """A collective whose wait fails the way gloo's does when the peer's process went away."""

    def wait(self) -> bool:
        WAITED.append("lost")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    def is_completed(self) -> bool:
        return False


class _StuckPeer(_LostPeer):
    """A collective whose wait fails the way gloo's does when a live peer never took part."""

    def wait(self) -> bool:
        WAITED.append("stuck")
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 1800000ms for recv operation to complete")


def on_ranks_cleanup_goes_on_past_a_failed_wait(stage: int, kind: str) -> dict:
    """A forward raises; then, on every rank, each unit is given a reduce-scatter whose wait fails
    (``kind``: "lost", a peer went away, also in the waiter thread; "stuck", a timeout). The next
    forward cleans up: it raises the failure, named, but only after every unit is idle and
    resharded; then a normal step trains."""
    import warnings

    from shardwrap import ShardedModule
    from shardwrap.collectives import CollectiveTimeout, PeerLost
    from shardwrap.unit import DataState, GradState, TrainingState, _Gather, _Reduction, _WaiterProbe

    torch.manual_seed(0)
    plain = models.mlp(8, 3)
    plain.blocks[1].register_forward_hook(failing_hook)
    model = ShardedModule(plain, auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),
             "y": torch.randn(4, 5, generator=torch.Generator().manual_seed(2))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert failing_step(model, batch, "forward")
        for unit in model.units:
            assert unit._reduction is None and unit._gather is None
            if kind == "lost":  # the waiter thread met the lost peer first, as in a real backward
                unit._reduction = _Reduction(_LostPeer(), torch.zeros(1), None, _WaiterProbe(_LostPeer()), True, [])
                unit._data = DataState.GATHERING  # as a gather whose wait raised leaves it (its _gather is gone)
            else:  # a gather too: after its timeout the unit's own reduction is not waited for either
                unit._gather = _Gather(_StuckPeer(), torch.zeros(1), torch.zeros(1))
                unit._reduction = _Reduction(_StuckPeer(), torch.zeros(1), None, None, True, [])
            unit._grad = GradState.IN_FLIGHT
        try:  # the waiter thread runs its waits in order: once this one is done, so are the probes'
            _WaiterProbe(_LostPeer()).join()
        except RuntimeError:
            pass
        WAITED.clear()
        try:
            model(batch["x"])
            error = ""
        except (PeerLost, CollectiveTimeout) as exc:
            error = f"{type(exc).__name__}: {exc}"
        waited = list(WAITED)
        settled_data = DataState.UNSHARDED if stage == 1 else DataState.SHARDED
        cleaned = {
            "idle": model._state is TrainingState.IDLE and all(u.training_state is TrainingState.IDLE for u in model.units),
            "data": all(u.data_state in (settled_data, DataState.UNSHARDED_STALE) for u in model.units),
            "grad": all(u.grad_state is GradState.NONE for u in model.units),
            "nothing_pending": all(u._packed is None and u._reduction is None and u._gather is None for u in model.units),
        }
        trained = not failing_step(model, batch, None)
        opt.step()
        opt.zero_grad()
    return {"error": error, "waited": waited, "units": len(model.units), "cleaned": cleaned, "trained": trained,
            "full": model.full_state_dict(rank0_only=False)}


@pytest.mark.parametrize("kind", ["lost", "stuck"])
@pytest.mark.parametrize("stage", [1, 3])
def test_cleanup_goes_on_past_a_failed_wait(stage, kind):
    """A wait that fails while a failed step is cleaned up is raised, named, after the cleanup:
    it never leaves a unit half cleaned. After a lost peer every other collective is still
    waited for (each fails at once); after a timeout none is, since each could take the whole
    timeout again."""
    torch.manual_seed(0)
    reference = models.mlp(8, 3)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    ((reference(x) - y) ** 2).mean().backward()
    opt.step()
    for r in run_on_ranks(2, on_ranks_cleanup_goes_on_past_a_failed_wait, stage, kind, timeout=90):
        expected = "PeerLost" if kind == "lost" else "CollectiveTimeout"
        assert r["error"].startswith(expected) and "left in flight by the failed step of unit" in r["error"], r["error"]
        assert r["waited"] == (["lost"] * r["units"] if kind == "lost" else ["stuck"]), r["waited"]
        assert all(r["cleaned"].values()), r["cleaned"]
        assert r["trained"]
        for name, value in reference.state_dict().items():
            assert_close_params(r["full"][name], value, "sgd", 1, name)


# ---- part 6: divergent ranks get a named error at every stage --------------------------------

EXTRA = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", steps=3)


def on_ranks_extra_forward(stage: int) -> dict:
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(EXTRA, model)
    try:
        for step in range(EXTRA.steps):
            batch = {k: v.chunk(world)[rank] for k, v in global_batch(EXTRA, step).items()}
            if step == 1 and rank == 0:
                model(batch["x"])  # one forward more than the other rank, its output unused
            ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None, "full": model.full_state_dict()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_extra_forward_on_one_rank_gives_the_answer_or_a_named_error(stage):
    from harness import RankError

    try:
        # A short process-group timeout: a rank whose peer already raised learns it at the timeout.
        results = run_on_ranks(2, on_ranks_extra_forward, stage, timeout=60, pg_timeout=5)
    except RankError as err:  # a rank raised something other than a RuntimeError
        raise AssertionError(err) from None
    errors = [r["error"] for r in results]
    if stage == 3:
        assert all(errors), errors  # the collectives no longer pair up
    if any(errors):
        assert any(m and "ranks disagree on the next collective" in m and "rank 0:" in m and "rank 1:" in m for m in errors), errors
        for message in errors:  # the rank that did not see the difference times out, naming where it waited
            assert message and ("ranks disagree on the next collective" in message or "process group's timeout" in message), errors
        return
    expected = train_reference_steps(EXTRA)
    for name, value in expected.items():
        assert_close_params(results[0]["full"][name], value, "sgd", EXTRA.steps, name)


def on_ranks_interrupt_after_a_header(stage: int, directory: str) -> dict:
    """Rank 1 gets a Ctrl-C while it waits in the header of its second gather in the second
    step's forward (Python raises a signal that came during a blocking call when the call
    returns). It tries to save a checkpoint, then goes on training (a notebook's interrupted
    cell run again); rank 0 trains on throughout. Returns what each rank saw."""
    import signal

    from shardwrap import ShardedModule, collectives, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(EXTRA, model)
    real, armed, seen = collectives.all_gather_ints, [False], [0]

    def header_then_ctrl_c(values, group, **kwargs):  # type: ignore[no-untyped-def]
        rows = real(values, group, **kwargs)
        if armed[0] and rank == 1 and kwargs.get("kind") == "headers" and values[0] & 0xFF == collectives.HEADER_FORWARD:
            seen[0] += 1
            if seen[0] == 2:
                signal.raise_signal(signal.SIGINT)  # as if it came during the wait
        return rows

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    collectives.all_gather_ints = header_then_ctrl_c
    out: dict = {"interrupted": None, "error": None}
    try:
        for step in range(EXTRA.steps):
            armed[0] = step == 1
            batch = {k: v.chunk(world)[rank] for k, v in global_batch(EXTRA, step).items()}
            try:
                ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
            except KeyboardInterrupt:
                try:
                    save_checkpoint(directory, model, opt)
                except RuntimeError as exc:  # refused before any collective: the step is unfinished
                    out["interrupted"] = str(exc)
                continue
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        out["error"] = str(exc)
    finally:
        collectives.all_gather_ints = real
        signal.signal(signal.SIGINT, previous)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_ctrl_c_between_a_header_and_its_gather_is_raised_after_the_gather_is_posted(stage, tmp_path):
    """A Ctrl-C that lands in a header's wait used to raise before the data gather the header
    announced was posted: the peer waited out the group's timeout for it, and the collectives
    after it paired wrongly (gloo aborts the process where their sizes differ: SIGABRT). The
    interrupt now comes after the post: a save right after it is refused before any collective,
    and the next forward's header meets the peer's, and both ranks name the difference."""
    results = run_on_ranks(2, on_ranks_interrupt_after_a_header, stage, str(tmp_path / "ckpt"), timeout=60, pg_timeout=10)
    assert results[0]["interrupted"] is None and "save_checkpoint" in results[1]["interrupted"], results
    for r in results:
        assert r["error"] and "ranks disagree on the next collective" in r["error"], results


def on_ranks_interrupt_in_a_calls_header(directory: str) -> dict:
    """Rank 1 gets a Ctrl-C while it waits in the header of a full_state_dict (a call between
    steps), then, as a training script does on its way out, asks for the state dict again; rank
    0 makes the same two calls."""
    import signal

    from shardwrap import ShardedModule, collectives

    rank = dist.get_rank()
    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block}, stage=3)
    real = collectives.all_gather_ints

    def header_then_ctrl_c(values, group, **kwargs):  # type: ignore[no-untyped-def]
        rows = real(values, group, **kwargs)
        if rank == 1 and kwargs.get("kind") == "headers" and values[0] & 0xFF == collectives.HEADER_CALL:
            collectives.all_gather_ints = real  # once
            signal.raise_signal(signal.SIGINT)  # as if it came during the wait
        return rows

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    collectives.all_gather_ints = header_then_ctrl_c
    out: dict = {"interrupted": False}
    try:
        try:
            model.full_state_dict(rank0_only=False)
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["full"] = model.full_state_dict(rank0_only=False)
    finally:
        collectives.all_gather_ints = real
        signal.signal(signal.SIGINT, previous)
    return out


def test_a_ctrl_c_in_the_header_of_a_call_between_steps_comes_after_the_call():
    """A call between steps (a state dict, a checkpoint) starts with a header, then its data
    collectives. A Ctrl-C raised after the header left the peer in the call's gathers, and the
    state dict saved on the way out met them: gloo aborted the process (a review, 2026-12-07).
    The call now runs to its end and the interrupt comes after it, so the next call pairs."""
    first, second = run_on_ranks(2, on_ranks_interrupt_in_a_calls_header, "", timeout=60, pg_timeout=10)
    assert not first["interrupted"] and second["interrupted"]
    for name, value in first["full"].items():
        torch.testing.assert_close(second["full"][name], value, rtol=0, atol=0)


class ChecksItsOutput(nn.Module):
    """EXTRA's model, whose forward raises on rank 0 when ``fail`` is set, after every unit ran
    (a validation check at the end of the root's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model(EXTRA)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        if self.fail and dist.get_rank() == 0:
            raise ValueError("a bad validation sample")
        return y


def on_ranks_eval_forward_raises_on_one_rank(stage: int) -> dict:
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(ChecksItsOutput(), auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(EXTRA, model)
    for step in range(EXTRA.steps):
        if step == 1:  # a validation loop that catches the error and goes on
            model.eval()
            model.fail = True
            with torch.no_grad():
                try:
                    model(torch.randn(4, 16))
                except ValueError:
                    pass
            model.fail = False
            model.train()
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(EXTRA, step).items()}
        ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_evaluation_forward_that_raised_on_one_rank_drops_nothing_and_training_goes_on(stage):
    """A failed pass counts in the history only where it dropped gradients: a no_grad evaluation
    forward that raised on one rank dropped none, and the ranks train on like one process (the
    first version of the history counted it, and the next step raised "ranks disagree")."""
    expected = train_reference_steps(EXTRA)
    full = run_on_ranks(2, on_ranks_eval_forward_raises_on_one_rank, stage, timeout=60, pg_timeout=10)[0]
    for name, value in expected.items():
        assert_close_params(full[f"net.{name}"], value, "sgd", EXTRA.steps, name)


APART = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", steps=3)


def on_ranks_a_step_apart(stage: int, fault: str) -> dict:
    """Three steps of SGD with momentum; in the second, rank 1 alone skips ``optimizer.step()``
    (``"skip"``: a NaN guard that decided on one rank), has it raise before it writes
    (``"raise"``: a closure that raises), or has the backward of the second of two ``no_sync``
    micro-batches raise inside a unit (``"no_sync"``); the loop catches it and goes on. Returns
    the first error, the step it came in, and this rank's shards at that moment."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(APART), auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(APART, model)
    faulty = rank == 1

    def fail(*_: object) -> None:
        raise ValueError("this rank's fault")

    def loss(batch: dict) -> torch.Tensor:
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    step = 0
    try:
        for step in range(APART.steps):
            batch = {k: v.chunk(world)[rank] for k, v in global_batch(APART, step).items()}
            if fault == "no_sync" and step == 1:
                with model.no_sync():
                    loss(batch).backward()
                    hook = model.module.blocks[1].register_full_backward_hook(fail) if faulty else None
                    try:  # inside the backward of the middle unit, after the head's
                        loss(batch).backward()
                    except ValueError:
                        pass
                    if hook is not None:
                        hook.remove()
            loss(batch).backward()
            if step == 1 and faulty and fault == "skip":
                opt.zero_grad()
                continue
            if step == 1 and faulty and fault == "raise":
                with pytest.raises(ValueError):
                    opt.step(fail)
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        return {"error": str(exc), "step": step, "local": local}
    return {"error": None, "step": step}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("fault", ["skip", "raise", "no_sync"])
def test_ranks_a_step_apart_are_named_before_they_train_on(stage, fault):
    """A rank that skipped a step, whose step raised, or that dropped a failed no_sync micro-batch
    runs the same units in the same order as its peers, so phase and unit alone cannot tell; the
    history in every header (optimizer steps that wrote the model, failed passes dropped) can.
    Every rank raises at its next collective, naming how the ranks' pasts differ, where training
    went on with one rank's shards a step behind (stages 2 and 3) or with the gradients of other
    batches (a failed micro-batch at stage 1)."""
    results = run_on_ranks(2, on_ranks_a_step_apart, stage, fault, timeout=60, pg_timeout=10)
    says = (
        "dropped a forward or backward that raised, and the others did not (rank 0: 0, rank 1: 1;"
        if fault == "no_sync"
        else "stepped this model a different number of times (rank 0: 2, rank 1: 1;"
    )
    for r in results:
        assert r["error"] and "ranks disagree" in r["error"], (stage, fault, r["error"])
        # (at stage 1 a rank that did not step has nothing to gather: the ranks meet at two
        # different collectives, which the message names, and the history is no diagnosis there)
        assert says in r["error"] or (stage == 1 and fault != "no_sync"), (stage, fault, r["error"])
    if fault != "no_sync":
        return
    # A failed micro-batch is named before anything of its step is reduced or stepped: each
    # rank's shards are those of the first step, as one process has them.
    after_one = train_reference_steps(Case(**{**APART.__dict__, "steps": 1}))
    for rank, r in enumerate(results):
        assert r["step"] == 1
        for name, value in after_one.items():
            torch.testing.assert_close(r["local"][name], expected_chunk(value, 2, rank), msg=name)


class Branchy(nn.Module):
    """``branch`` (4 x 8) runs only where ``use`` is set; ``head`` (4 x 4) always: units of other
    sizes, so reduce-scatters that paired across them met pairwise messages of other lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.branch, self.head = nn.Linear(4, 8), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.head(x + self.branch(x)[:, :4] if use else x)


def on_ranks_skipped_unit(stage: int, mode: str) -> list[str]:
    from shardwrap import ShardedModule

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ShardedModule(Branchy(), auto_wrap_policy={nn.Linear}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for step in range(3):
        use = step == 0 or rank == 0  # from step 1 on, the last rank's forwards leave the branch out
        try:
            if mode != "forward":  # micro-batches under no_sync: stages 1 and 2 gather nothing in their forwards
                with model.no_sync():
                    model(torch.randn(2, 4), use).sum().backward()
            # "micro": only the no_sync micro-batch differs; the syncing forwards leave the branch out
            # on every rank, and the branch's gradient is reduced at the end of backward on rank 0 alone
            model(torch.randn(2, 4), use and (mode != "micro" or step == 0)).sum().backward()
            opt.step()
            opt.zero_grad()
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", ["forward", "no_sync", "micro"])
def test_a_unit_one_rank_skips_in_forward_gives_a_named_error_on_every_rank(stage, mode):
    """Stage 1's forward (and stage 2's, after a no_sync micro-batch) gathers nothing, so no header
    caught a forward that left a unit out on one rank: the backward's reduce-scatters paired across
    different units, silently where the sizes agreed, and a fuzz run ended in gloo's abort
    (SIGABRT) where they did not. The first count exchange of each backward now carries a digest of
    its reduce-scatter order (with the units holding no_sync gradients, which a review found left
    out of the first version), and no reduce-scatter starts before it is compared."""
    for errors in run_on_ranks(2, on_ranks_skipped_unit, stage, mode, timeout=60, pg_timeout=5):
        assert errors, "no error: the ranks reduced different units without noticing"
        assert "ranks disagree" in errors[0], errors
        assert all("ranks disagree" in e or "last checkpoint" in e for e in errors), errors


def on_ranks_go_on_after_disagreeing(stage: int, tmp: str) -> dict:
    """Rank 0 alone runs an evaluation forward after step 0 (a bug: "log a sample on rank 0"); the
    training loop catches each step's error and goes on, then saves. Every call's outcome, per rank."""
    from shardwrap import ShardedModule, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(EXTRA, model)
    outcomes: list[str] = []

    def attempt(what, call) -> None:  # type: ignore[no-untyped-def]
        try:
            call()
            outcomes.append(f"{what}: ok")
        except RuntimeError as exc:
            outcomes.append(f"{what}: {exc}")

    def step(i: int) -> None:
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(EXTRA, i).items()}
        ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and i == 0:
            with torch.no_grad():
                model.eval()
                model(batch["x"])
                model.train()

    for i in range(4):
        attempt(f"step {i}", lambda: step(i))
    attempt("full_state_dict", model.full_state_dict)
    attempt("clip_grad_norm_", lambda: model.clip_grad_norm_(1.0))
    attempt("save_checkpoint", lambda: save_checkpoint(f"{tmp}/ckpt", model, opt))
    return {"outcomes": outcomes}


@pytest.mark.parametrize("stage", [2, 3])
def test_after_ranks_disagreed_every_later_call_is_refused_on_every_rank(stage, tmp_path):
    """Once a header shows the ranks out of step, the module issues no collective again: a loop
    that catches the error and goes on gets the same refusal on every rank for every later step,
    state dict, clip and save, where its collectives paired across steps (a whole step trained on
    one rank against another's evaluation) and then met a collective of another size (SIGABRT)."""
    results = run_on_ranks(2, on_ranks_go_on_after_disagreeing, stage, str(tmp_path), timeout=120, pg_timeout=10)
    firsts = []
    for r in results:
        outcomes = r["outcomes"]
        first = next(i for i, o in enumerate(outcomes) if not o.endswith(": ok"))
        # A rank that has not seen its peer's exchange yet waits for its next collective, which
        # times out: then it refuses too, naming the timeout
        firsts.append(outcomes[first])
        assert "ranks disagree" in outcomes[first] or "did not complete within the process group's timeout" in outcomes[first], outcomes
        later = outcomes[first + 1 :]
        assert len(later) >= 3 and all("refused: the ranks fell out of step earlier" in o for o in later), outcomes
    assert any("ranks disagree" in f for f in firsts), firsts
    assert not (tmp_path / "ckpt").exists()


def train_reference_steps(case: Case) -> dict:
    model = build_model(case)
    opt = build_optimizer(case, model)
    for step in range(case.steps):
        batch = global_batch(case, step)
        ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def on_ranks_stalled_rank() -> str:
    import time

    from shardwrap import ShardedModule

    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block})
    if dist.get_rank() == 1:
        time.sleep(4)  # past the 2 s process-group timeout
    try:
        model(torch.randn(2, 16))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def on_ranks_go_on_after_a_timeout() -> list[str]:
    """Rank 1 stalls past the timeout in its first forward; then every rank tries a forward and a
    full state dict more."""
    import time

    from shardwrap import ShardedModule

    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block})
    if dist.get_rank() == 1:
        time.sleep(5)  # past the 2.5 s process-group timeout
    errors = []
    for call in (lambda: model(torch.randn(2, 16)), lambda: model(torch.randn(2, 16)), model.full_state_dict):
        try:
            call()
            errors.append("no error")
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_after_a_timeout_the_module_issues_no_collective():
    """gloo closes its connection to a peer after a timeout, and a collective left in flight then
    may never finish: the next forward waits for nothing and refuses, as does every later call,
    naming the timeout (or, on the stalled rank, the connection its peer closed), instead of
    hanging in the cleanup."""
    # a pool of its own (another timeout): after a timeout gloo has closed the pool's connections
    first, second = run_on_ranks(2, on_ranks_go_on_after_a_timeout, timeout=60, pg_timeout=2.5)
    assert "did not complete within the process group's timeout" in first[0], first
    assert "another rank's process went away" in second[0], second  # rank 0 closed the connection
    for errors, cause in ((first, "timed out"), (second, "went away")):
        for later in errors[1:]:
            assert "refused: the ranks fell out of step earlier" in later and cause in later, errors


def test_a_stalled_rank_gives_a_timeout_error_naming_the_unit_and_collective():
    messages = run_on_ranks(2, on_ranks_stalled_rank, timeout=60, pg_timeout=2)
    assert "all-gather of unit '<root>' in forward of step 1" in messages[0], messages
    assert "did not complete within the process group's timeout" in messages[0] and "init_process_group(timeout=" in messages[0], messages


def on_ranks_stalled_in_backward(stage: int, where: str) -> str:
    """Rank 1's backward raises in a block's backward hook (its loop catches it), or rank 1 skips
    ``clip_grad_norm_``'s norm: rank 0 waits in the reduce-scatter (on the reduce group
    shardwrap makes) or in the clip's all-reduce. The reduce group was made with ``new_group``'s
    own 30-minute default instead of the job's timeout, and a pairwise receive's wait had none:
    rank 0 hung far past the 2 s timeout; the clip's all-reduce timed out in gloo's raw words."""
    import time

    from shardwrap import ShardedModule, collectives

    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block}, stage=stage)
    if where == "backward" and dist.get_rank() == 1:
        def fail(*args: object) -> None:
            raise ValueError("planted in rank 1's backward")

        model.module.blocks[1].register_full_backward_hook(fail)
    started, real = time.monotonic(), collectives.all_reduce_sum
    try:
        model(torch.randn(2, 16)).sum().backward()
        if where == "clip":
            if dist.get_rank() == 1:
                collectives.all_reduce_sum = lambda *a, **k: None  # rank 1 leaves out the norm's all-reduce
            model.clip_grad_norm_(1.0)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    except RuntimeError as exc:
        message = f"{type(exc).__name__}: {exc}"
    finally:
        collectives.all_reduce_sum = real
    return f"{time.monotonic() - started:.0f}s {message}"


@pytest.mark.parametrize("stage,where", [(2, "backward"), (3, "clip")])
def test_a_rank_left_waiting_in_backward_or_clip_gets_a_named_timeout(stage, where):
    first, second = run_on_ranks(2, on_ranks_stalled_in_backward, stage, where, timeout=60, pg_timeout=2, fresh=True)
    waited, message = first.split(" ", 1)
    want = "reduce-scatter of unit" if where == "backward" else "clip_grad_norm_'s all-reduce of the norm"
    assert message.startswith("CollectiveTimeout") and want in message, (first, second)
    assert int(waited[:-1]) < 30, first  # the job's timeout (2 s), not new_group's 30 minutes


def on_ranks_dead_peer(path: str) -> None:
    """Rank 1 dies (its process ends, its connections close) after one step; rank 0 goes on and
    writes the error it gets to ``path``."""
    import os

    from shardwrap import ShardedModule

    model = ShardedModule(build_model(EXTRA), auto_wrap_policy={models.Block})
    model(torch.randn(2, 16)).sum().backward()
    if dist.get_rank() == 1:
        os._exit(1)
    try:
        for _ in range(3):
            model(torch.randn(2, 16)).sum().backward()
        message = "no error"
    except RuntimeError as exc:
        message = f"{type(exc).__name__}: {exc}"
    with open(path, "w") as f:
        f.write(message)


def test_a_dead_peer_gives_a_clear_error_naming_the_collective(tmp_path):
    """gloo reports the closed connection at once; shardwrap says what it means, naming the unit,
    the collective and the step, instead of gloo's bare 'Connection reset by peer'."""
    from harness import RankTimeout

    path = str(tmp_path / "rank0.txt")
    with pytest.raises(RankTimeout, match="died"):
        run_on_ranks(2, on_ranks_dead_peer, path, timeout=60, fresh=True)
    message = open(path).read()
    assert message.startswith("PeerLost: rank 0: the "), message
    assert "of unit '" in message and "of step 2" in message and "another rank's process went away" in message, message


# ---- parameters written between a forward and its backward ----------------------------------

BETWEEN = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", steps=4)


def write_between(how: str, model, opt, snapshot, path: str | None) -> None:  # type: ignore[no-untyped-def]
    """The write that lands between step 2's forward and its backward (plain model or sharded)."""
    if how == "step":  # the gradients of step 1 are still there (no zero_grad before this step)
        opt.step()
    elif how == "in_place":
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    elif how == "load_state_dict":
        model.load_state_dict(snapshot["model"])
    elif how == "load_checkpoint":
        from shardwrap import load_checkpoint

        if path is None:  # the plain model: what the checkpoint holds
            model.load_state_dict(snapshot["model"])
            opt.load_state_dict(snapshot["opt"])
        else:
            load_checkpoint(path, model, opt)


def train_writing_between(how: str, stage: int | None, path: str | None = None) -> dict:
    """Step 0 trains (and snapshots after it); step 2's forward is followed by ``how`` and then its
    backward, which must raise; training goes on. ``stage`` None: the unwrapped model on the
    global batch."""
    import copy

    rank, world = (0, 1) if stage is None else (dist.get_rank(), dist.get_world_size())
    model = build_model(BETWEEN)
    if stage is not None:
        from shardwrap import ShardedModule, save_checkpoint

        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage)
    opt = build_optimizer(BETWEEN, model)
    errors, snapshot = [], {}
    for step in range(BETWEEN.steps):
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(BETWEEN, step).items()}
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        if step == 2:
            write_between(how, model, opt, snapshot, path)
            try:
                loss.backward()
                errors.append("no error")
            except RuntimeError as exc:
                errors.append(str(exc))
            opt.zero_grad()
            continue
        loss.backward()
        if step == 1 and how == "step":
            continue  # its gradients stay for the step between step 2's forward and backward
        opt.step()
        opt.zero_grad()
        if step == 0:
            if stage is None:
                snapshot = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
            else:
                snapshot = {"model": model.full_state_dict(rank0_only=False)}
                if path is not None:
                    save_checkpoint(path, model, opt)
    full = model.full_state_dict() if stage is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"errors": errors, "full": full}


def on_ranks_write_between(how: str, stage: int, path: str) -> dict:
    return train_writing_between(how, stage, path)


@pytest.mark.parametrize("how", ["step", "in_place", "load_state_dict", "load_checkpoint"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_written_between_a_forward_and_its_backward_are_refused_like_plain_pytorch(stage, how, tmp_path):
    # the backward took gradients of the new parameters against the old activations at stage 3
    # (it gathers again) and of the old ones at stages 1 and 2, silently; plain PyTorch raises
    expected = train_writing_between(how, None)
    assert "modified by an inplace operation" in expected["errors"][0]
    results = run_on_ranks(2, on_ranks_write_between, how, stage, str(tmp_path / "ckpt"), timeout=60)
    for r in results:
        assert len(r["errors"]) == 1 and "written after the forward" in r["errors"][0], r["errors"]
        assert "'blocks.0'" in r["errors"][0] and "Call backward() before" in r["errors"][0], r["errors"]
    full = results[0]["full"]
    assert set(full) == set(expected["full"])
    for name, value in expected["full"].items():  # the write itself stands, and training goes on
        assert_close_params(full[name], value, "sgd", BETWEEN.steps, name)


class ForeachSGD(torch.optim.SGD):
    """A subclass: it steps the DTensors themselves, and with foreach no version counter moves."""


def write_around_backwards(how: str, stage: int | None) -> dict:
    """``how``: "two_backwards": forwards A and B, A's backward, a step, B's backward (plain PyTorch
    raises); "subclass_step": a foreach step of an SGD subclass between a forward and its backward
    (raises); "state_dict_between": forward 1, ``state_dict()``, forward 2, one backward of both
    (trains). Returns the error, or "no error" and the parameters after one more step."""
    rank, world = (0, 1) if stage is None else (dist.get_rank(), dist.get_world_size())
    model = build_model(BETWEEN)
    if stage is not None:
        from shardwrap import ShardedModule

        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage)
    opt = ForeachSGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)

    def loss(step: int) -> torch.Tensor:
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(BETWEEN, step).items()}
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    loss(0).backward()  # gradients for the step below
    error = "no error"
    try:
        if how == "two_backwards":
            a, b = loss(1), loss(2)
            a.backward()
            opt.step()
            b.backward()
        elif how == "subclass_step":
            a = loss(1)
            opt.step()
            a.backward()
        else:
            a = loss(1)
            model.state_dict()  # marks the shards as maybe written: stage 1 gathers again in the next forward
            b = loss(2)
            (a + b).backward()
            opt.step()
    except RuntimeError as exc:
        error = str(exc)
    full = model.full_state_dict() if stage is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"error": error, "full": full}


def on_ranks_write_around_backwards(how: str, stage: int) -> dict:
    return write_around_backwards(how, stage)


@pytest.mark.parametrize("how", ["two_backwards", "subclass_step", "state_dict_between"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_writes_between_forwards_and_backwards_are_refused_exactly_where_plain_pytorch_refuses(stage, how):
    # a review of the check: a step between two backwards over retained graphs (a GAN's
    # retain_graph=True, then optD.step()) and a foreach step on the DTensors went through; a
    # state_dict() between two forwards made stage 1's re-gather look like a write
    expected = write_around_backwards(how, None)
    results = run_on_ranks(2, on_ranks_write_around_backwards, how, stage, timeout=60)
    refused = how != "state_dict_between"
    assert ("modified by an inplace operation" in expected["error"]) == refused, expected["error"]
    for r in results:
        assert ("written after the forward" in r["error"]) == refused, r["error"]
        assert refused or r["error"] == "no error", r["error"]
    if not refused:
        for name, value in expected["full"].items():
            assert_close_params(results[0]["full"][name], value, "sgd", 2, name)
