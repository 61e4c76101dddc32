"""Stand-ins the configuration tests put in place of chunkmem's classes."""


class RecordingLowLevelZero:
    """Stands in for LowLevelZeroOptimizer (in chunkmem.faces.config): records the arguments the config maps to,
    and accepts every argument check."""

    def __init__(self, optimizer, **kwargs):
        self.optimizer = optimizer
        self.kwargs = kwargs

    @staticmethod
    def check_arguments(optimizer, *, cast_to=None, **kwargs):
        """initialize checks the arguments before it casts the module (nothing to check here)."""
