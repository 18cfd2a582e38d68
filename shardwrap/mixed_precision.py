"""Mixed precision: which dtypes the all-gather, the compute, the reduce-scatter and the buffers use.

The sharded master parameters, which the optimizer sees and updates, always keep the model's own
dtype (fp32). See design/notes/mixed-precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: all-gather and compute. ``reduce_dtype``: gradient reduce-scatter
    (defaults to ``param_dtype``). ``buffer_dtype``: buffers are cast to it once, at wrap time
    (``None`` keeps each buffer's dtype)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(
                    f"MixedPrecision({f.name}={value!r}): expected a floating torch.dtype such as "
                    f"torch.bfloat16 or torch.float16, or None"
                )


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floating(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj
