"""chunkmem: train PyTorch models whose parameters, gradients and optimizer states do not fit in GPU
memory, by packing them into chunks that move between the device and host tiers."""
from .adam import CPUAdam, HybridAdam
from .checkpoint import CheckpointError, consolidate_checkpoint, load_checkpoint, save_checkpoint
from .errors import (ArgumentTypeError, ChunkmemError, DeviceCapacityError, GradientAccumulationError,
                     InvalidArgumentError)
from .init_context import ZeroInitContext
from .loss_scaler import DynamicGradScaler
from .model import ShardedModelV2
from .optimizer import ShardedOptimizerV2
from .shard_strategy import BaseShardStrategy, BucketTensorShardStrategy, TensorShardStrategy
from .tiers import Tier, device_memory_capacity, parse_size, set_device_memory_capacity

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError", "BaseShardStrategy", "BucketTensorShardStrategy", "CPUAdam", "CheckpointError",
    "ChunkmemError", "DeviceCapacityError", "DynamicGradScaler", "GradientAccumulationError", "HybridAdam",
    "InvalidArgumentError", "ShardedModelV2", "ShardedOptimizerV2", "TensorShardStrategy", "Tier",
    "ZeroInitContext", "consolidate_checkpoint", "device_memory_capacity", "load_checkpoint", "parse_size",
    "save_checkpoint", "set_device_memory_capacity",
]
