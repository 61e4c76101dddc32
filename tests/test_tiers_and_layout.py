"""Capacity parsing and setting; packing and the chunk-size search against brute force."""
import random

import pytest

import chunkmem as cm
from chunkmem.core.layout import ALIGN_ELEMENTS, chunk_sizes, pack, padding_elements, plan_layout, search_chunk_numel


@pytest.mark.parametrize("text,nbytes", [("1048576", 2**20), ("2GiB", 2 * 2**30), ("512 MiB", 512 * 2**20),
                                         ("1.5KB", 1500), ("3gb", 3 * 10**9), ("7B", 7), (123, 123)])
def test_parse_size(text, nbytes):
    assert cm.parse_size(text) == nbytes


def test_capacity_setting_and_environment(monkeypatch):
    monkeypatch.setenv("CHUNKMEM_DEVICE_MEMORY", "3MiB")
    assert cm.device_memory_capacity() == 3 * 2**20
    cm.set_device_memory_capacity("1KiB")
    assert cm.device_memory_capacity() == 1024
    cm.set_device_memory_capacity(None)
    assert cm.device_memory_capacity() == 3 * 2**20
    monkeypatch.delenv("CHUNKMEM_DEVICE_MEMORY")
    assert cm.device_memory_capacity() > 0


def test_pack_never_straddles_or_mixes_keys():
    numels = [5, 3, 4, 8, 1, 1, 6]
    keys = ["a", "a", "a", "b", "b", "a", "a"]
    assert pack(numels, keys, 8) == [[0, 1], [2], [3], [4], [5, 6]]
    assert padding_elements(numels, keys, 8) == 5 * 8 - sum(numels)
    with pytest.raises(ValueError):
        pack([9], ["a"], 8)


def test_the_last_chunk_of_each_kind_holds_only_its_parameters():
    """A tail (the last chunk of a run of one key) is trimmed to its parameters, rounded up to whole
    64-element groups in each rank's shard; the others keep the chunk size."""
    numels = [600, 300, 500, 100, 700, 50]
    keys = ["a", "a", "a", "b", "b", "a"]
    groups = pack(numels, keys, 1024)
    assert groups == [[0, 1], [2], [3, 4], [5]]
    assert chunk_sizes(groups, numels, keys, 1024) == [1024, 512, 832, 64]
    assert chunk_sizes(groups, numels, keys, 1024, world=4) == [1024, 512, 1024, 256]
    assert padding_elements(numels, keys, 1024) == 1024 + 512 + 832 + 64 - sum(numels)
    params = [(f"p{i}", type("P", (), {"numel": lambda self, n=n: n})()) for i, n in enumerate(numels)]
    layout = plan_layout(params, [True] * 6, 1024, 4)
    assert layout.groups == ((0, 1), (2, 3), (4, 5))
    assert layout.numels == (1024, 1024, 768)  # one kind: only the last chunk is a tail
    assert [layout.shard_bytes(i, 1) for i in range(3)] == [4096, 4096, 3072]
    assert plan_layout(params, [True] * 6, 1024, 4, trim_tails=False).numels == (1024,) * 3


def test_search_finds_least_padding_among_candidates():
    rng = random.Random(0)
    numels = [rng.choice([768 * 768, 768, 3072 * 768, 3072, 768]) for _ in range(60)]
    keys = [0] * len(numels)
    best = search_chunk_numel(numels, keys, element_size=2, min_chunk_bytes=0)
    assert best % ALIGN_ELEMENTS == 0 and best >= max(numels)
    lower = -(-max(numels) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    step = -(-max(lower // 64, 1) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    candidates = [lower + k * step for k in range(65)]
    least = min(padding_elements(numels, keys, c) for c in candidates)
    # nothing staged: the largest size within 1% of the parameters of the least padding
    assert best == max(c for c in candidates if padding_elements(numels, keys, c) <= least + 0.01 * sum(numels))
    assert padding_elements(numels, keys, best) <= least + 0.01 * sum(numels)
    assert len(pack(numels, keys, best)) <= min(len(pack(numels, keys, c)) for c in candidates
                                                 if padding_elements(numels, keys, c) == least)


def test_search_weighs_the_staged_buffers_against_padding():
    """With chunk-sized buffers staged on the device tier (placement other than "cuda"), the search takes
    the size of the fewest bytes in all: 16 bytes a padding element at rest plus the staged buffers; here
    (a 4M-element embedding and 19M in blocks of 786K-3.1M) 6 chunks instead of the 4 of least padding,
    which the "cuda" placement keeps, over 10 MB fewer."""
    from chunkmem.core.layout import RESTING_BYTES_PER_ELEMENT, staged_buffers

    numels = [8192 * 512, 1024 * 512] + [512, 512, 1536 * 512, 1536, 512 * 512, 512, 512, 512,
                                         2048 * 512, 2048, 512 * 2048, 512] * 6 + [512, 512]
    keys = [True] * len(numels)
    assert staged_buffers("cuda", sharded=False) == 0
    assert staged_buffers("cuda", sharded=True) == staged_buffers("cpu", False) == staged_buffers("auto", False) == 2
    least_padding = search_chunk_numel(numels, keys, 4)
    staged = search_chunk_numel(numels, keys, 4, staged_buffers=2)

    def total_bytes(c: int) -> int:
        return padding_elements(numels, keys, c) * RESTING_BYTES_PER_ELEMENT + 2 * c * 4

    lower = -(-max(numels) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    step = -(-max(lower // 64, 1) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    assert (total_bytes(staged), staged) == min((total_bytes(lower + k * step), lower + k * step) for k in range(65))
    assert len(pack(numels, keys, staged)) == 6 and len(pack(numels, keys, least_padding)) == 4
    assert total_bytes(least_padding) - total_bytes(staged) > 10 * 2**20
