"""The disk tier's I/O engine (chunkmem/disk_io.py): scratch space, aligned requests, failures."""
import errno
import gc
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

from chunkmem import ArgumentTypeError, ChunkmemError, InvalidArgumentError
from chunkmem.storage import disk_io
from chunkmem.storage.disk_io import (ALIGNMENT, AlignedBufferPool, DiskIOError, ScratchSpace, aligned_nbytes, inject_faults,
                              measure_bandwidth)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_bytes(buf: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=generator))
    return buf


def file_bytes(path: str, offset: int, nbytes: int) -> bytes:
    """The file's bytes read with plain Python I/O (the reference)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def private_dirs(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("chunkmem-"))


def test_aligned_nbytes():
    assert [aligned_nbytes(n) for n in (0, 1, 4095, 4096, 4097, 10 * 4096)] == [0, 4096, 4096, 4096, 8192, 40960]
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        aligned_nbytes(-1)


@pytest.mark.parametrize("direct", [None, False])
def test_round_trip_at_several_offsets(tmp_path, direct, monkeypatch):
    monkeypatch.setattr(disk_io, "PIECE_NBYTES", 3 * ALIGNMENT)  # split requests into several pieces
    with ScratchSpace(tmp_path, direct=direct) as space:
        if direct is False:
            assert space.direct is False
        # this machine's filesystems accept O_DIRECT; where one refuses it, None falls back to buffered
        disk_file = space.file("chunk0.fp32", 10 * ALIGNMENT + 1)
        assert disk_file.nbytes == 11 * ALIGNMENT and os.path.getsize(disk_file.path) == 11 * ALIGNMENT
        assert space.bytes_on_disk() == 11 * ALIGNMENT
        pool = AlignedBufferPool(2, 4 * ALIGNMENT)
        out, back = pool.take(), pool.take()
        for seed, (offset, length) in enumerate([(0, 4), (7, 4), (3, 1), (10, 1)]):  # in blocks; the last ends the file
            offset, length = offset * ALIGNMENT, length * ALIGNMENT
            data = random_bytes(out[:length], seed)
            disk_file.write_from(data, offset, "chunk0.fp32").wait()
            assert file_bytes(disk_file.path, offset, length) == bytes(data.numpy())
            back.zero_()
            handle = disk_file.read_into(back[:length], offset, "chunk0.fp32")
            assert handle.nbytes == length
            handle.wait()
            assert handle.done()
            assert torch.equal(back[:length], data)


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with ScratchSpace(tmp_path) as space:
        assert space.direct is False
        disk_file = space.file("f", ALIGNMENT)
        buf = random_bytes(AlignedBufferPool(1, ALIGNMENT).take(), 1)
        disk_file.write_from(buf, 0, "f").wait()
        assert file_bytes(disk_file.path, 0, ALIGNMENT) == bytes(buf.numpy())
    with pytest.raises(InvalidArgumentError, match="direct=True"):
        ScratchSpace(tmp_path, direct=True)
    assert private_dirs(tmp_path) == []


def test_many_requests_in_flight(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_io, "PIECE_NBYTES", 2 * ALIGNMENT)
    blocks, block = 12, 8 * ALIGNMENT
    with ScratchSpace(tmp_path) as space:
        files = [space.file(f"chunk{i}", blocks * block) for i in range(3)]
        pool = AlignedBufferPool(2 * blocks * len(files), block)
        sources = [random_bytes(pool.take(), seed) for seed in range(blocks * len(files))]
        writes = [files[i % 3].write_from(src, (i // 3) * block, f"chunk{i % 3}") for i, src in enumerate(sources)]
        for handle in writes:
            handle.wait()
        targets = [pool.take() for _ in sources]
        reads = [files[i % 3].read_into(dst, (i // 3) * block, f"chunk{i % 3}") for i, dst in enumerate(targets)]
        for handle in reads:
            handle.wait()
        for i, (src, dst) in enumerate(zip(sources, targets)):
            assert torch.equal(src, dst), i
            assert file_bytes(files[i % 3].path, (i // 3) * block, block) == bytes(src.numpy())


def test_bad_requests_are_refused(tmp_path):
    with ScratchSpace(tmp_path) as space:
        disk_file = space.file("f", 4 * ALIGNMENT)
        buf = AlignedBufferPool(1, 2 * ALIGNMENT).take()
        with pytest.raises(InvalidArgumentError, match="offset=100"):
            disk_file.read_into(buf, 100, "f")
        with pytest.raises(InvalidArgumentError, match="offset=12288"):
            disk_file.read_into(buf, 3 * ALIGNMENT, "f")  # runs past the end of the file
        with pytest.raises(InvalidArgumentError, match="buf="):
            disk_file.read_into(buf[1:ALIGNMENT + 1], 0, "f")  # misaligned address
        with pytest.raises(InvalidArgumentError, match="buf="):
            disk_file.read_into(buf[:100], 0, "f")  # misaligned length
        with pytest.raises(InvalidArgumentError, match="buf="):
            disk_file.write_from(buf.view(torch.int32), 0, "f")
        with pytest.raises(ArgumentTypeError, match="what="):
            disk_file.write_from(buf, 0, 3)
        with pytest.raises(InvalidArgumentError, match="name="):
            space.file("a/b", 10)
        space.file("g", 1)
        with pytest.raises(InvalidArgumentError, match="name='g'"):
            space.file("g", 1)
        with pytest.raises(InvalidArgumentError, match="nbytes=4096"):
            disk_file.grow(ALIGNMENT)  # smaller than the file
    with pytest.raises(ChunkmemError, match="closed"):
        disk_file.read_into(buf, 0, "f")
    with pytest.raises(ChunkmemError, match="closed"):
        space.file("h", 1)


def test_directory_removed_after_close(tmp_path):
    space = ScratchSpace(tmp_path)
    path = space.path
    assert os.path.dirname(path) == str(tmp_path) and os.path.isdir(path)
    assert private_dirs(tmp_path) == [os.path.basename(path)]
    disk_file = space.file("f", 2 * ALIGNMENT)
    handle = disk_file.write_from(random_bytes(AlignedBufferPool(1, 2 * ALIGNMENT).take(), 0), 0, "f")
    space.close()  # waits for the write in flight
    assert handle.done()
    handle.wait()
    assert not os.path.exists(path) and space.closed
    space.close()  # idempotent


def test_directory_removed_after_garbage_collection(tmp_path):
    space = ScratchSpace(tmp_path)
    disk_file = space.file("f", ALIGNMENT)
    disk_file.write_from(random_bytes(AlignedBufferPool(1, ALIGNMENT).take(), 0), 0, "f").wait()
    path = space.path
    del space
    assert os.path.isdir(path)  # the file still holds its space
    del disk_file
    gc.collect()
    assert not os.path.exists(path)


def test_directory_removed_at_exit_also_after_an_exception(tmp_path):
    start = ("import os, sys\nfrom chunkmem.storage.disk_io import ScratchSpace, AlignedBufferPool\n"
             f"s = ScratchSpace({str(tmp_path)!r}); f = s.file('f', 8192)\n"
             "f.write_from(AlignedBufferPool(1, 8192).take(), 0, 'f')\n"  # perhaps still in flight at exit
             "print(s.path, flush=True)\n")
    endings = {"exception": "raise RuntimeError('boom')\n",
               # a normal end without close(), after a forked child that ends normally and leaves the
               # parent's directory alone
               "fork": "pid = os.fork()\nif pid == 0: sys.exit(0)\n"
                       "os.waitpid(pid, 0); print('kept' if os.path.isdir(s.path) else 'removed', flush=True)\n"}
    children = {name: subprocess.Popen([sys.executable, "-c", start + ending], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
                for name, ending in endings.items()}
    for name, child in children.items():
        out, err = child.communicate(timeout=120)
        assert (child.returncode != 0) == (name == "exception"), err
        assert "RuntimeError: boom" in err if name == "exception" else err == ""
        path, *rest = out.split()
        assert rest == (["kept"] if name == "fork" else [])
        assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert private_dirs(tmp_path) == []


def ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def make_leftover(directory, pid: int, start_time, token: str = "ab12") -> str:
    path = os.path.join(directory, f"chunkmem-{pid}-{token}")
    os.mkdir(path)
    with open(os.path.join(path, "owner.json"), "w") as f:
        f.write(f'{{"pid": {pid}, "hostname": "{disk_io.socket.gethostname()}", "start_time": "{start_time}"}}')
    with open(os.path.join(path, "chunk0"), "wb") as f:
        f.write(b"old state")
    return path


def test_leftovers_of_ended_processes_are_removed(tmp_path):
    dead = make_leftover(tmp_path, ended_pid(), "123")
    live = make_leftover(tmp_path, os.getpid(), disk_io.process_start_time(os.getpid()), "cd34")
    reused_pid = make_leftover(tmp_path, os.getpid(), "1", "ef56")  # same pid, another process's start time
    unmarked_dead = os.path.join(tmp_path, f"chunkmem-{ended_pid()}-0a")  # no marker: judged by the pid
    unmarked_live = os.path.join(tmp_path, f"chunkmem-{os.getpid()}-0b")
    other = os.path.join(tmp_path, "chunkmem-notes")  # not a private directory's name
    for path in (unmarked_dead, unmarked_live, other):
        os.mkdir(path)
    with pytest.warns(UserWarning) as caught:
        space = ScratchSpace(tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    for removed in (dead, reused_pid, unmarked_dead):
        assert not os.path.exists(removed) and repr(removed) in messages
    for kept in (live, unmarked_live, other):
        assert os.path.isdir(kept) and repr(kept) not in messages
    assert len(caught) == 3
    space.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ScratchSpace(tmp_path).close()  # nothing left to remove: no warning


def test_bad_nvme_path_is_refused_and_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"x")
    for path, text in ((missing, "does not exist"), (a_file, "is a file")):
        with pytest.raises(InvalidArgumentError, match=f"nvme_path=.*{text}"):
            ScratchSpace(path)
    with pytest.raises(InvalidArgumentError, match=r"directory=.*does not exist"):
        ScratchSpace(str(missing), argument="directory")
    with pytest.raises(ArgumentTypeError, match="nvme_path=3"):
        ScratchSpace(3)
    assert not missing.exists() and sorted(os.listdir(tmp_path)) == ["a_file"]


def test_read_only_nvme_path_is_refused(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("this user (root) may write into a 0o500 directory")
        with pytest.raises(InvalidArgumentError, match="nvme_path=.*read-only"):
            ScratchSpace(read_only)
        assert os.listdir(read_only) == []
    finally:
        read_only.chmod(0o700)


def test_full_disk_at_create_and_grow(tmp_path, monkeypatch):
    real_fallocate = os.posix_fallocate
    full = {"on": False}

    def fallocate(fd, offset, length):
        if full["on"]:
            real_fallocate(fd, offset, ALIGNMENT)  # a partial allocation before the disk filled up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with ScratchSpace(tmp_path) as space:
        grown = space.file("grown", 2 * ALIGNMENT)
        full["on"] = True
        with pytest.raises(DiskIOError) as info:
            space.file("chunk1.exp_avg", 100 * ALIGNMENT)
        error = info.value
        assert error.errno == errno.ENOSPC and error.operation == "create"
        assert error.path == os.path.join(space.path, "chunk1.exp_avg") and error.path in str(error)
        assert "No space left on device" in str(error) and isinstance(error, OSError)
        assert sorted(os.listdir(space.path)) == ["grown", "owner.json"]  # no file left behind
        with pytest.raises(DiskIOError, match="No space left") as info:
            grown.grow(10 * ALIGNMENT)
        assert info.value.path == grown.path
        assert grown.nbytes == os.path.getsize(grown.path) == 2 * ALIGNMENT == space.bytes_on_disk()
        full["on"] = False
        grown.grow(3 * ALIGNMENT + 1)
        assert grown.nbytes == os.path.getsize(grown.path) == 4 * ALIGNMENT == space.bytes_on_disk()
        space.file("chunk1.exp_avg", ALIGNMENT)  # the name is free again
        assert space.bytes_on_disk() == 5 * ALIGNMENT


def test_injected_short_read_and_io_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_io, "PIECE_NBYTES", 2 * ALIGNMENT)
    with ScratchSpace(tmp_path) as space:
        disk_file = space.file("chunk3", 8 * ALIGNMENT)
        buf = random_bytes(AlignedBufferPool(1, 8 * ALIGNMENT).take(), 3)
        disk_file.write_from(buf, 0, "chunk3.exp_avg").wait()
        with inject_faults(short_read=True, after=1, what="chunk3.") as faults:
            disk_file.read_into(buf, 0, "chunk3.exp_avg").wait()  # the first matching read runs normally
            disk_file.read_into(buf, 0, "chunk4.exp_avg").wait()  # another prefix: not matched
            handle = disk_file.read_into(buf, 0, "chunk3.exp_avg_sq")
            for _ in range(2):  # on every wait
                with pytest.raises(DiskIOError) as info:
                    handle.wait()
                error = info.value
                assert error.path == disk_file.path and error.what == "chunk3.exp_avg_sq"
                assert error.operation == "read" and error.errno is None
                assert f"short read: got {7 * ALIGNMENT} of {8 * ALIGNMENT} bytes (at offset 0)" in str(error)
                assert disk_file.path in str(error) and "chunk3.exp_avg_sq" in str(error)
            disk_file.write_from(buf, 0, "chunk3.exp_avg").wait()  # writes are not matched
        assert faults.failed == 1
        with inject_faults(read_errno=errno.EIO, times=1):
            with pytest.raises(DiskIOError, match=r"read of chunk3\.master failed on .*Input/output error") as info:
                disk_file.read_into(buf, 0, "chunk3.master").wait()
            assert info.value.errno == errno.EIO and isinstance(info.value.__cause__, OSError)
            disk_file.read_into(buf, 0, "chunk3.master").wait()  # times=1: the next one succeeds
        with inject_faults(write_errno=errno.EIO, what="chunk3"):
            for _ in range(2):
                with pytest.raises(DiskIOError, match="write of chunk3.fp16") as info:
                    disk_file.write_from(buf, 0, "chunk3.fp16").wait()
                assert info.value.errno == errno.EIO and info.value.path == disk_file.path
        disk_file.read_into(buf, 0, "chunk3.exp_avg").wait()  # no faults outside the block
        with pytest.raises(InvalidArgumentError, match="short_read"):
            with inject_faults(read_errno=errno.EIO, short_read=True):
                pass


def test_real_short_read_of_a_truncated_file(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_io, "PIECE_NBYTES", 2 * ALIGNMENT)
    with ScratchSpace(tmp_path) as space:
        disk_file = space.file("chunk5", 8 * ALIGNMENT)
        buf = AlignedBufferPool(1, 8 * ALIGNMENT).take()
        os.truncate(disk_file.path, 5 * ALIGNMENT)  # something else cut the file
        with pytest.raises(DiskIOError, match=rf"read of chunk5.master failed on '{disk_file.path}': short read: "
                                              rf"got {5 * ALIGNMENT} of {8 * ALIGNMENT} bytes"):
            disk_file.read_into(buf, 0, "chunk5.master").wait()


def test_disk_io_error_pickles():
    error = DiskIOError("/d/chunk3", "chunk3.exp_avg", "write", "No space left on device (errno ENOSPC)",
                        errno.ENOSPC)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.what, copy.operation, copy.errno, str(copy)) == \
           (error.path, error.what, error.operation, error.errno, str(error))
    assert isinstance(copy, ChunkmemError) and isinstance(copy, OSError)


def test_aligned_buffer_pool():
    pool = AlignedBufferPool(3, 5000)
    assert (pool.count, pool.buffer_nbytes, pool.free) == (3, 8192, 3)
    assert pool.total_nbytes in ((3 * 8192, 3 * 8192 + ALIGNMENT) if torch.cuda.is_available() else (3 * 8192,))
    assert pool.pinned == torch.cuda.is_available()
    taken = [pool.take() for _ in range(3)]
    assert pool.free == 0
    addresses = sorted(b.data_ptr() for b in taken)
    assert all(a % ALIGNMENT == 0 for a in addresses) and all(b.numel() == 8192 and b.dtype == torch.uint8
                                                              for b in taken)
    assert [b - a for a, b in zip(addresses, addresses[1:])] == [8192, 8192]  # disjoint
    with pytest.raises(ChunkmemError, match="all 3 buffers"):
        pool.take()
    pool.give_back(taken[1])
    assert pool.free == 1 and pool.take().data_ptr() == taken[1].data_ptr()
    pool.give_back(taken[0])
    with pytest.raises(InvalidArgumentError, match="not given back yet"):
        pool.give_back(taken[0])
    with pytest.raises(InvalidArgumentError, match="buf="):
        pool.give_back(torch.empty(8192, dtype=torch.uint8))
    for count in (0, -1):
        with pytest.raises(InvalidArgumentError, match=f"buffer_count={count}"):
            AlignedBufferPool(count, 10)
    with pytest.raises(ArgumentTypeError, match="buffer_count"):
        AlignedBufferPool(2.0, 10)


def test_measure_bandwidth(tmp_path):
    read, write = measure_bandwidth(tmp_path, nbytes=2**20 + 1, block=256 * 2**10)
    assert read > 0 and write > 0
    assert private_dirs(tmp_path) == []
    with pytest.raises(InvalidArgumentError, match="directory="):
        measure_bandwidth(tmp_path / "missing", nbytes=2**20)
