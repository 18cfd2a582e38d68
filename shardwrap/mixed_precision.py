"""Mixed precision: which dtypes the all-gather, the compute, the reduce-scatter and the buffers use.

The sharded master parameters, which the optimizer sees and updates, always keep the model's own
dtype (fp32). See design/notes/mixed-precision.md.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: all-gather and compute. ``reduce_dtype``: gradient reduce-scatter
    (defaults to ``param_dtype``). ``buffer_dtype``: buffers are cast to it once, at wrap time
    (``None`` keeps each buffer's dtype). ``output_dtype``: each unit's floating outputs are cast
    to it (``None``: left as computed). ``cast_forward_inputs``: each unit casts its floating
    inputs to ``param_dtype``. The last two, and ``param_dtype`` and ``reduce_dtype``, mean what
    they mean in ``fully_shard``'s ``MixedPrecisionPolicy``, which ``of`` turns into this."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cast_forward_inputs":
                if not isinstance(value, bool):
                    raise ValueError(f"MixedPrecision(cast_forward_inputs={value!r}): expected True or False")
            elif value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(
                    f"MixedPrecision({f.name}={value!r}): expected a floating torch.dtype such as "
                    f"torch.bfloat16 or torch.float16, or None"
                )

    @staticmethod
    def of(policy: Any) -> "MixedPrecision":
        """``policy`` itself, or ``fully_shard``'s ``MixedPrecisionPolicy`` with the same meaning."""
        if isinstance(policy, MixedPrecision):
            return policy
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if isinstance(policy, MixedPrecisionPolicy):
            return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                  output_dtype=policy.output_dtype, cast_forward_inputs=policy.cast_forward_inputs)
        raise TypeError(
            f"ShardedModule: mixed_precision={policy!r}; pass shardwrap.MixedPrecision(param_dtype=..., "
            f"reduce_dtype=...), torch's MixedPrecisionPolicy, or None"
        )


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor inside cast to ``dtype``: tuples (namedtuples keep their
    type), lists, dicts (their type kept where it can be rebuilt from pairs) and dataclasses, as
    ``fully_shard`` casts a module's inputs. Other objects are passed as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        items = [cast_floating(o, dtype) for o in obj]
        if hasattr(obj, "_fields"):  # a namedtuple: built from its fields
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, list):
        return [cast_floating(o, dtype) for o in obj]
    if isinstance(obj, dict):
        pairs = [(k, cast_floating(v, dtype)) for k, v in obj.items()]
        try:
            return type(obj)(pairs)
        except Exception:  # a mapping type built otherwise: a plain dict holds the same entries
            return dict(pairs)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(changed, field.name, cast_floating(getattr(obj, field.name), dtype))  # frozen ones too
        return changed
    return obj
