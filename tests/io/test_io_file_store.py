"""The file tier: round trips, checksums, missing records, full disk, read-only directories,
header refusal. Every failure must be clear and must not lose what was written before."""

import errno
import logging
import os
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pystronghold.ops import crc32c
from pystronghold.io import CopyEngine, CopyError, FileStore
from tmpfs import small_tmpfs

KiB, MiB = 1 << 10, 1 << 20


def random_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


def unaligned(n: int) -> torch.Tensor:
    """A tensor of n bytes whose data pointer is not 4096-aligned (exercises the bounce buffer)."""
    return torch.empty(n + 4096, dtype=torch.uint8)[3:3 + n]


@pytest.fixture
def engine():
    with CopyEngine(threads=2, queues=4, chunk_bytes=1 * MiB) as eng:
        yield eng


def test_crc32c_matches_the_standard_check_value_in_both_paths():
    check = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert crc32c(check) == 0xE3069283
    assert crc32c(check, force_software=True) == 0xE3069283
    for n in (0, 1, 7, 8, 9, 1023, (1 << 20) + 3):
        data = random_bytes(n)
        assert crc32c(data) == crc32c(data, force_software=True)


@pytest.mark.parametrize("direct", ["auto", "never"])
def test_round_trip_many_records_reopen(tmp_path, engine, direct, caplog):
    sizes = {"master": 3 * MiB + 5, "exp_avg": 64 * KiB, "tiny": 1}
    with caplog.at_level(logging.INFO, logger="pystronghold.io.file_store"):
        store = FileStore.create(tmp_path / "store", num_blocks=5, record_bytes=sizes, engine=engine,
                                 segment_bytes=1 * MiB, direct=direct)
    if direct == "never":
        assert not store.direct_io("master") and "buffered I/O" in caplog.text
    data = {(b, s): random_bytes(n) for b in range(5) for s, n in sizes.items()}
    handles = []
    for i, ((block, state), src) in enumerate(data.items()):
        if i % 2:  # half of the sources are unaligned host buffers
            src_u = unaligned(src.numel())
            src_u.copy_(src)
            src = src_u
        handles.append(store.write(block, state, src, queue=i % 4))
    for h in handles:
        h.wait()
    store.flush()
    store.close()
    again = FileStore.open(tmp_path / "store", engine=engine, direct=direct)
    assert again.states == sizes and again.num_blocks == 5
    reads = {}
    for i, (key, src) in enumerate(data.items()):
        dst = unaligned(src.numel()) if i % 3 else torch.empty(src.numel(), dtype=torch.uint8)
        reads[key] = (again.read(*key, dst, queue=i % 4), dst)
    for key, (h, dst) in reads.items():
        h.wait()
        assert h.nbytes == sizes[key[1]]
        assert torch.equal(dst, data[key]), key


def test_flipped_byte_is_caught_and_other_records_survive(tmp_path, engine):
    store = FileStore.create(tmp_path, num_blocks=3, record_bytes={"w": 2 * MiB + 100}, engine=engine,
                             segment_bytes=1 * MiB)
    data = [random_bytes(2 * MiB + 100) for _ in range(3)]
    for b, d in enumerate(data):
        store.write(b, "w", d).wait()
    store.flush()
    path = store.path("w")
    slot_bytes = 4096 + (2 * MiB + 100 + 4095) // 4096 * 4096  # record meta + padded payload
    block1 = 4096 + slot_bytes  # after the file header
    payload_byte = block1 + 4096 + 1 * MiB + 17  # block 1, second segment
    with open(path, "r+b") as f:
        f.seek(payload_byte)
        old = f.read(1)
        f.seek(payload_byte)
        f.write(bytes([old[0] ^ 0x40]))
    dst = torch.empty(2 * MiB + 100, dtype=torch.uint8)
    with pytest.raises(CopyError, match=r"block 1, in .*w\.psr at offset \d+, size 2097252 bytes: checksum "
                                        r"mismatch .* the record is corrupt") as info:
        store.read(1, "w", dst).wait()
    assert info.value.path == str(path) and info.value.offset == block1 and info.value.nbytes == 2 * MiB + 100
    for b in (0, 2):
        store.read(b, "w", dst).wait()
        assert torch.equal(dst, data[b])
    with open(path, "r+b") as f:  # a damaged record header is caught too
        f.seek(4096 + 2 * slot_bytes + 20)
        f.write(b"\x7f")
    with pytest.raises(CopyError, match="block 2, .*record header is corrupt"):
        store.read(2, "w", dst).wait()


def test_never_written_record_is_an_error_not_zeros(tmp_path, engine):
    store = FileStore.create(tmp_path, num_blocks=4, record_bytes={"m": 10_000}, engine=engine, segment_bytes=4096)
    store.write(0, "m", random_bytes(10_000)).wait()
    dst = torch.empty(10_000, dtype=torch.uint8)
    h = store.read(3, "m", dst)
    dependent = engine.copy(torch.empty(10_000, dtype=torch.uint8), dst, queue=2, after=[h])
    with pytest.raises(CopyError, match=r"state 'm', block 3, in .*m\.psr .* was never written"):
        h.wait()
    with pytest.raises(CopyError, match=r"not run: a request it waits for \(`after`\) failed: .*never written"):
        dependent.wait()
    late = engine.copy(torch.empty(10_000, dtype=torch.uint8), dst, after=[h])  # h failed before this
    with pytest.raises(CopyError, match=r"not run: .*never written"):
        late.wait()


def fill_until_full(directory: Path, engine: CopyEngine, record_bytes: int, blocks: int, after_create=None):
    """Write blocks of a sparse store until one fails; return (store, records written, the error)."""
    store = FileStore.create(directory, num_blocks=blocks, record_bytes={"m": record_bytes}, engine=engine,
                             segment_bytes=256 * KiB, preallocate=False)
    if after_create is not None:
        after_create()
    written = []
    for b in range(blocks):
        data = random_bytes(record_bytes)
        try:
            store.write(b, "m", data).wait()
        except CopyError as exc:
            return store, written, exc
        written.append(data)
    return store, written, None


def check_full_disk_outcome(store, written, error, expected_errno):
    assert error is not None, "the disk never filled"
    assert error.errno == expected_errno and error.path == str(store.path("m")) and error.offset >= 0
    assert f"write to {store.path('m')} at offset {error.offset}" in str(error)
    assert 1 <= len(written)
    dst = torch.empty(store.record_bytes("m"), dtype=torch.uint8)
    for b, data in enumerate(written):  # everything written before the failure is intact
        store.read(b, "m", dst).wait()
        assert torch.equal(dst, data)


def test_full_disk_removes_the_preallocated_file_and_fails_sparse_writes(engine):
    with small_tmpfs(3 * MiB) as mount:
        if mount is None:
            pytest.skip("cannot mount a tmpfs here; test_disk_full_by_file_size_limit covers the path")
        with pytest.raises(RuntimeError, match=r"preallocating \d+ bytes for .*big\.psr failed: No space left "
                                               r"on device .*the file was removed"):
            FileStore.create(mount / "pre", num_blocks=8, record_bytes={"big": MiB}, engine=engine)
        assert not (mount / "pre" / "big.psr").exists()
        store, written, error = fill_until_full(mount / "sparse", engine, record_bytes=MiB, blocks=8)
        check_full_disk_outcome(store, written, error, errno.ENOSPC)


def _run_fsize_limited(directory: str) -> None:  # runs in a subprocess with RLIMIT_FSIZE set
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = 4096 + 2 * (4096 + 256 * KiB) + 10 * KiB  # room for the header and two records

    def limit_file_size():  # after creation: sizing the sparse file would hit the limit too
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    with CopyEngine(threads=2) as eng:
        store, written, error = fill_until_full(Path(directory), eng, record_bytes=256 * KiB, blocks=6,
                                                after_create=limit_file_size)
        check_full_disk_outcome(store, written, error, errno.EFBIG)


def test_disk_full_by_file_size_limit(tmp_path):
    """The same failure through RLIMIT_FSIZE (works without root): EFBIG instead of ENOSPC."""
    here = Path(__file__).parent  # this module, and tests/ for the helpers it imports
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
            f"import test_io_file_store as t; t._run_fsize_limited({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_read_only_directory(tmp_path, engine):
    with small_tmpfs(8 * MiB) as mount:
        root = mount if mount is not None else tmp_path
        if mount is None and os.geteuid() == 0:
            pytest.skip("running as root without mount: permissions cannot make a directory read-only")
        store = FileStore.create(root / "s", num_blocks=2, record_bytes={"a": 5000}, engine=engine)
        data = random_bytes(5000)
        store.write(0, "a", data).wait()
        store.flush()
        store.close()
        del store
        if mount is not None:
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        else:
            os.chmod(root / "s" / "a.psr", 0o444)
            os.chmod(root / "s", 0o555)
        try:
            ro = FileStore.open(root / "s", engine=engine)
            assert ro.read_only
            dst = torch.empty(5000, dtype=torch.uint8)
            ro.read(0, "a", dst).wait()
            assert torch.equal(dst, data)
            with pytest.raises(RuntimeError, match=r"block 1\): the store is read-only \(opened read-only: .*a\.psr "
                                                   r"cannot be opened for writing: (Read-only file system|Permission denied)"):
                ro.write(1, "a", data)
            with pytest.raises(RuntimeError, match=r"cannot create .*b\.psr: (Read-only file system|Permission denied)"):
                FileStore.create(root / "s", num_blocks=1, record_bytes={"b": 10}, engine=engine)
            ro.close()
        finally:
            if mount is None:
                os.chmod(root / "s", 0o755)


def test_foreign_or_incompatible_files_are_refused(tmp_path, engine):
    store = FileStore.create(tmp_path / "v", num_blocks=1, record_bytes={"m": 100}, engine=engine)
    store.close()
    path = tmp_path / "v" / "m.psr"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))
    with pytest.raises(RuntimeError, match=r"m\.psr: store format version 2, but this pystronghold reads version 1 only"):
        FileStore.open(tmp_path / "v", engine=engine)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "junk.psr").write_bytes(b"hello" * 1000)
    with pytest.raises(RuntimeError, match="not a pystronghold file-tier store"):
        FileStore.open(tmp_path / "x", engine=engine)
    FileStore.create(tmp_path / "t", num_blocks=4, record_bytes={"m": 8192}, engine=engine).close()
    os.truncate(tmp_path / "t" / "m.psr", 8192)
    with pytest.raises(RuntimeError, match=r"truncated: 8192 bytes, the layout needs \d+"):
        FileStore.open(tmp_path / "t", engine=engine)
    with pytest.raises(FileNotFoundError, match="no .psr files"):
        FileStore.open(tmp_path / "x" / "..", engine=engine)


def test_bad_requests_are_refused_clearly(tmp_path, engine):
    store = FileStore.create(tmp_path, num_blocks=2, record_bytes={"m": 64}, engine=engine)
    with pytest.raises(RuntimeError, match=r"write\(state 'm', block 0\): the tensor holds 60 bytes, but records of this state hold 64"):
        store.write(0, "m", torch.empty(15))
    with pytest.raises(RuntimeError, match=r"block must be in \[0, 1\]"):
        store.read(2, "m", torch.empty(16))
    with pytest.raises(KeyError, match="no state 'x'"):
        store.read(0, "x", torch.empty(16))
    with pytest.raises(RuntimeError, match="cannot create .*m.psr: File exists"):
        FileStore.create(tmp_path, num_blocks=2, record_bytes={"m": 64}, engine=engine)
    with pytest.raises(ValueError, match="state name 'a/b'"):
        FileStore.create(tmp_path, num_blocks=2, record_bytes={"a/b": 64}, engine=engine)
    with pytest.raises(RuntimeError, match="segment_bytes must be a positive multiple of 4096"):
        FileStore.create(tmp_path / "z", num_blocks=2, record_bytes={"m": 64}, engine=engine, segment_bytes=1000)
    store.close()
    with pytest.raises(RuntimeError, match="the store is closed"):
        store.write(0, "m", torch.empty(16))
