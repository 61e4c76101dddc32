"""The optimizers: the mixed-precision step, Adam kernels, ShardedOptimizerV2, LowLevelZeroOptimizer, the disk step."""
