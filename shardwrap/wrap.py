"""Wrap policies: which submodules become units.

A policy's ``select(root)`` returns the modules (never ``root`` itself) that start a unit.
``ShardedModule`` accepts a set or tuple of module classes, a callable ``(module) -> bool``,
a ``SizePolicy``, or ``None`` (the root unit only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Union, runtime_checkable

import torch.nn as nn


@runtime_checkable
class WrapPolicy(Protocol):
    def select(self, root: nn.Module) -> list[nn.Module]: ...


@dataclass(frozen=True)
class ModuleTypePolicy:
    """Every submodule that is an instance of one of ``classes`` starts a unit."""

    classes: tuple[type[nn.Module], ...]

    def select(self, root: nn.Module) -> list[nn.Module]:
        return [m for m in root.modules() if m is not root and isinstance(m, self.classes)]


@dataclass(frozen=True)
class CallablePolicy:
    """Every submodule for which ``fn(module)`` is true starts a unit."""

    fn: Callable[[nn.Module], bool]

    def select(self, root: nn.Module) -> list[nn.Module]:
        return [m for m in root.modules() if m is not root and self.fn(m)]


def has_forward(module: nn.Module) -> bool:
    """Whether the module's class defines ``forward`` (``nn.ModuleList`` and ``nn.ModuleDict`` do
    not: they are never called, so they cannot be units)."""
    return type(module).forward is not nn.Module.forward


@dataclass(frozen=True)
class SizePolicy:
    """Bottom-up: a submodule starts a unit when the parameters it would own (those not already
    owned by a unit below it) number at least ``min_num_params``. A container without a forward
    of its own (``nn.ModuleList``, ``nn.ModuleDict``) never does: its parameters count towards its
    parent, as torch's ``size_based_auto_wrap_policy`` leaves those containers out."""

    min_num_params: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_num_params, int) or self.min_num_params < 1:
            raise ValueError(f"SizePolicy(min_num_params={self.min_num_params!r}): expected a positive int")

    def select(self, root: nn.Module) -> list[nn.Module]:
        selected: list[nn.Module] = []

        def unowned(module: nn.Module) -> int:
            count = sum(p.numel() for p in module.parameters(recurse=False))
            for child in module.children():
                below = unowned(child)
                if below >= self.min_num_params and has_forward(child):
                    selected.append(child)
                else:
                    count += below
            return count

        unowned(root)
        return selected


PolicyLike = Union[None, WrapPolicy, set, frozenset, tuple, list, Callable[[nn.Module], bool]]


def as_policy(policy: PolicyLike) -> WrapPolicy | None:
    """Normalize the ``auto_wrap_policy`` argument, or raise a TypeError that says what to pass."""
    if policy is None or isinstance(policy, WrapPolicy):
        return policy
    if isinstance(policy, (set, frozenset, tuple, list)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(
                f"auto_wrap_policy: {bad!r} in the given collection is not an nn.Module subclass; "
                f"pass module classes such as {{GPT2Block}}"
            )
        return ModuleTypePolicy(tuple(policy))
    if isinstance(policy, type):
        raise TypeError(
            f"auto_wrap_policy={policy.__name__}: pass a set of classes such as {{{policy.__name__}}}, "
            f"not the class itself"
        )
    if isinstance(policy, nn.Module):
        raise TypeError(
            f"auto_wrap_policy={type(policy).__name__}(...) is a module instance; pass a set of module "
            f"classes such as {{{type(policy).__name__}}}"
        )
    if callable(policy):
        return CallablePolicy(policy)
    raise TypeError(
        f"auto_wrap_policy={policy!r}: expected None, a set or tuple of nn.Module classes, "
        f"a callable (module) -> bool, or shardwrap.SizePolicy(min_num_params=...)"
    )
