"""shardwrap: FSDP-style ZeRO sharding over flat parameters, built on DTensor."""

from shardwrap.mixed_precision import MixedPrecision
from shardwrap.sharded_module import ShardedModule
from shardwrap.wrap import CallablePolicy, ModuleTypePolicy, SizePolicy, WrapPolicy

__all__ = ["ShardedModule", "MixedPrecision", "SizePolicy", "ModuleTypePolicy", "CallablePolicy", "WrapPolicy"]
__version__ = "0.1.0"
