"""shardwrap: FSDP-style ZeRO sharding over flat parameters, built on DTensor."""

from shardwrap.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
    export_to_torch_save,
    load_checkpoint,
    load_full,
    save_checkpoint,
    save_full,
)
from shardwrap.collectives import CollectiveTimeout, PeerLost
from shardwrap.mixed_precision import MixedPrecision
from shardwrap.offload import Offload
from shardwrap.sharded_module import ShardedModule
from shardwrap.stage import Stage
from shardwrap.wrap import CallablePolicy, ModuleTypePolicy, SizePolicy, WrapPolicy

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "save_full",
    "load_full",
    "export_to_torch_save",
    "CheckpointError",
    "DamagedCheckpointError",
    "UnsafeCheckpointError",
    "UnverifiedCheckpointWarning",
    "CollectiveTimeout",
    "PeerLost",
    "ShardedModule", "Stage", "MixedPrecision", "Offload", "SizePolicy", "ModuleTypePolicy", "CallablePolicy", "WrapPolicy"]
__version__ = "0.1.0"
