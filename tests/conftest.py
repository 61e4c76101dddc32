import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _default_capacity(monkeypatch):
    """Every test starts with the default device capacity and no CHUNKMEM_DEVICE_MEMORY."""
    import chunkmem

    monkeypatch.delenv("CHUNKMEM_DEVICE_MEMORY", raising=False)
    chunkmem.set_device_memory_capacity(None)
    yield
    chunkmem.set_device_memory_capacity(None)
