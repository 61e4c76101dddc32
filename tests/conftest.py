import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, lightning, the test modules: several hundred thousand
    objects) is moved out of the collector's reach once: the full collection after every test
    (``_no_counting_mode_left``) then walks only what the tests made, not every imported object again."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _default_capacity(monkeypatch):
    """Every test starts with the default device capacity and no CHUNKMEM_DEVICE_MEMORY."""
    import chunkmem

    monkeypatch.delenv("CHUNKMEM_DEVICE_MEMORY", raising=False)
    chunkmem.set_device_memory_capacity(None)
    yield
    chunkmem.set_device_memory_capacity(None)


@pytest.fixture(autouse=True)
def _no_counting_mode_left():
    """No test may leave an active dispatch mode (chunkmem's tracer counts storages with one): it would
    slow down, and change, every later test in the process. The counter of a trace whose model was
    dropped before its backward is inert once collected (chunkmem removes it at the next trace); such
    inert ones are removed here."""
    import gc

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    yield
    gc.collect()
    left = _get_current_dispatch_mode_stack()
    active = [mode for mode in left if not getattr(mode, "stopped", False)]
    while _get_current_dispatch_mode_stack():
        _pop_mode()
    assert not active, f"dispatch modes left active: {active}"


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    """No launcher's variables at a test's start: chunkmem.deepspeed.initialize sets LOCAL_RANK for a process that
    had none, as DeepSpeed's does, and a later test whose library reads it (Accelerate) would take this process
    for one of several ranks."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
