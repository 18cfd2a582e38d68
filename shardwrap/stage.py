"""What a ZeRO stage is: three switches on one machinery [design/notes/stages.md].

``stage=1|2|3`` is the user's shorthand; ``Stage.of`` turns it into the switches the unit reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """``reshard_after_forward``: post_forward frees the unsharded parameters (they are gathered
    again for backward). ``reshard_after_backward``: post_backward and the end of backward free
    them. ``keep_unsharded_grad``: one unsharded gradient buffer per unit lives for the whole run,
    and without mixed precision the shard is the rank's rows of the unsharded parameters, which
    then stay for good (ZeRO-1)."""

    reshard_after_forward: bool
    reshard_after_backward: bool
    keep_unsharded_grad: bool = False

    def __post_init__(self) -> None:
        if self.reshard_after_forward and not self.reshard_after_backward:
            raise ValueError(
                "Stage(reshard_after_forward=True, reshard_after_backward=False): a unit freed after "
                "forward is gathered again for backward and would then stay unsharded; set both"
            )
        if self.keep_unsharded_grad and (self.reshard_after_forward or self.reshard_after_backward):
            raise ValueError(
                "Stage(keep_unsharded_grad=True) keeps the unsharded parameters for good; it needs "
                "reshard_after_forward=False and reshard_after_backward=False (that is stage 1)"
            )

    @staticmethod
    def of(stage: "int | Stage") -> "Stage":
        if isinstance(stage, Stage):
            return stage
        if isinstance(stage, bool) or stage not in _ZERO:
            raise ValueError(f"ShardedModule: stage={stage!r} is not a ZeRO stage; use 1, 2 or 3 (or a shardwrap.Stage)")
        return _ZERO[stage]


_ZERO = {
    1: Stage(reshard_after_forward=False, reshard_after_backward=False, keep_unsharded_grad=True),
    2: Stage(reshard_after_forward=False, reshard_after_backward=True),
    3: Stage(reshard_after_forward=True, reshard_after_backward=True),
}
