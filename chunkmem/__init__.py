"""chunkmem: train PyTorch models whose parameters, gradients and optimizer states do not fit in GPU
memory, by packing them into chunks that move between the device and host tiers."""
from . import utils
from .adam import CPUAdam, HybridAdam
from .agreement import LayoutMismatchError
from .checkpoint import CheckpointError, consolidate_checkpoint, load_checkpoint, save_checkpoint
from .disk_io import DiskIOError
from .disk_step import DiskStepError
from .collectives import CollectiveError, CollectiveTimeoutError, collective_timeout, set_collective_timeout
from .errors import (ArgumentTypeError, ChunkmemError, DeviceCapacityError, GradientAccumulationError,
                     HostCapacityError, InvalidArgumentError, UnscaledBackwardError, UnsupportedOperationError)
from .init_context import ZeroInitContext
from .loss_scaler import DynamicGradScaler
from .model import ShardedModelV2
from .optimizer import ShardedOptimizerV2
from .param_guard import ChunkGradient, ChunkParameter, ParameterAccessError
from .parameter_access import GatheredParameters, register_external_parameter
from .states import ChunkStateError
from .shard_strategy import BaseShardStrategy, BucketTensorShardStrategy, TensorShardStrategy
from .tiers import (Tier, device_memory_capacity, host_memory_capacity, parse_size, set_device_memory_capacity,
                    set_host_memory_capacity)

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError", "BaseShardStrategy", "BucketTensorShardStrategy", "CPUAdam", "CheckpointError", "ChunkGradient",
    "ChunkParameter", "ChunkStateError", "ChunkmemError", "CollectiveError", "CollectiveTimeoutError",
    "DeviceCapacityError", "DiskIOError", "DiskStepError", "DynamicGradScaler", "GatheredParameters", "GradientAccumulationError", "HostCapacityError",
    "HybridAdam",
    "InvalidArgumentError", "LayoutMismatchError", "ParameterAccessError", "ShardedModelV2", "ShardedOptimizerV2",
    "TensorShardStrategy", "Tier", "UnscaledBackwardError", "UnsupportedOperationError", "ZeroInitContext",
    "collective_timeout", "consolidate_checkpoint", "device_memory_capacity", "host_memory_capacity",
    "load_checkpoint", "parse_size",
    "register_external_parameter", "save_checkpoint", "set_collective_timeout", "set_device_memory_capacity",
    "set_host_memory_capacity",
]
