"""chunkmem: train PyTorch models whose parameters, gradients and optimizer states do not fit in GPU
memory, by packing them into chunks that move between the device, host and disk tiers."""
from . import accessors, utils
from .optim.adam import CPUAdam, HybridAdam
from .io.checkpoint import consolidate_checkpoint, load_checkpoint, save_checkpoint
from .distributed.collectives import collective_timeout, set_collective_timeout
from .faces.config import initialize
from .faces.engine import TrainingEngine, initialize_engine
from .errors import (ArgumentTypeError, CheckpointError, ChunkmemError, ChunkStateError, CollectiveError,
                     CollectiveTimeoutError, DeviceCapacityError, DiskIOError, DiskStepError, GradientAccumulationError,
                     HostCapacityError, InvalidArgumentError, LayoutMismatchError, NoEffectWarning, ParameterAccessError,
                     StepMismatchError, UnscaledBackwardError, UnsupportedOperationError)
from .faces.init_context import ZeroInitContext
from .optim.loss_scaler import DynamicGradScaler
from .optim.low_level_zero import LowLevelZeroOptimizer
from .optim.zero_gradient_view import ZeroGradient
from .model.sharded_model import ShardedModelV2
from .optim.sharded_optimizer import ShardedOptimizerV2
from .core.param_guard import ChunkGradient, ChunkParameter
from .runtime.parameter_access import GatheredParameters, register_external_parameter
from .plan import Candidate, PlanChoice, PolicyPlan, choose, plan
from .plan.machine_profile import MachineProfile
from .faces.tiled_linear import TiledLinear
from .distributed.shard_strategy import BaseShardStrategy, BucketTensorShardStrategy, TensorShardStrategy
from .core.copy_engine import set_copy_engine
from .core.pinned import set_pinned_memory_budget
from .core.tiers import (Tier, device_memory_capacity, host_memory_capacity, parse_size, set_device_memory_capacity,
                    set_host_memory_capacity)

__version__ = "0.1.0"

__all__ = [
    "accessors", "ArgumentTypeError", "BaseShardStrategy", "BucketTensorShardStrategy", "CPUAdam", "Candidate", "CheckpointError",
    "ChunkGradient", "ChunkParameter", "ChunkStateError", "ChunkmemError", "CollectiveError",
    "CollectiveTimeoutError", "DeviceCapacityError", "DiskIOError", "DiskStepError", "DynamicGradScaler",
    "GatheredParameters", "GradientAccumulationError", "HostCapacityError", "HybridAdam", "InvalidArgumentError",
    "LayoutMismatchError", "LowLevelZeroOptimizer", "MachineProfile", "NoEffectWarning", "ParameterAccessError",
    "PlanChoice", "PolicyPlan",
    "ShardedModelV2", "ShardedOptimizerV2", "StepMismatchError", "TensorShardStrategy", "Tier", "TiledLinear",
    "TrainingEngine", "UnscaledBackwardError", "choose",
    "UnsupportedOperationError",
    "ZeroGradient", "ZeroInitContext", "collective_timeout", "consolidate_checkpoint", "device_memory_capacity",
    "host_memory_capacity", "initialize", "initialize_engine", "load_checkpoint", "parse_size", "plan", "register_external_parameter",
    "save_checkpoint", "set_collective_timeout", "set_copy_engine", "set_device_memory_capacity", "set_host_memory_capacity",
    "set_pinned_memory_budget", "utils",
]
