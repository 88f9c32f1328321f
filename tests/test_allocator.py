import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psrec import allocator


def test_tune_malloc_exports_the_settings_and_respects_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    if allocator._libc() is None:
        pytest.skip("not glibc")
    for name in allocator.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PSREC_MALLOC_TUNING", "0")
    assert allocator.tune_malloc() is False
    assert allocator.malloc_environment() == {}
    assert not any(name in os.environ for name in allocator.SETTINGS)
    monkeypatch.delenv("PSREC_MALLOC_TUNING")
    assert allocator.tune_malloc() is True
    assert {name: os.environ[name] for name in allocator.SETTINGS} == {
        name: str(value) for name, value in allocator.SETTINGS.items()
    }
    assert allocator.malloc_environment() == {name: str(v) for name, v in allocator.SETTINGS.items()}
    assert allocator.tune_malloc() is False  # already set (by us or the user): left alone


def test_user_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    if allocator._libc() is None:
        pytest.skip("not glibc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert allocator.tune_malloc() is False
    assert allocator.malloc_environment()["MALLOC_TRIM_THRESHOLD_"] == "12345"


def test_the_cli_exports_the_settings_to_its_children() -> None:
    env = {k: v for k, v in os.environ.items() if k not in allocator.SETTINGS and k != "PSREC_MALLOC_TUNING"}
    code = "import os, psrec.cli as c; c.tune_malloc(); print(os.environ.get('MALLOC_TRIM_THRESHOLD_'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = str(allocator.SETTINGS["MALLOC_TRIM_THRESHOLD_"]) if allocator._libc() is not None else "None"
    assert out.stdout.strip() == expected


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("kernel_call", [True, False], ids=["madvise", "page-writes"])
def test_populate_backs_the_pages_and_keeps_the_contents(
    kernel_call: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    if not kernel_call:
        monkeypatch.setattr(allocator, "_libc", lambda: None)
    memory = mmap.mmap(-1, 64 << 20)  # a fresh anonymous mapping: no page touched yet
    array = np.frombuffer(memory, dtype=np.float32).reshape(-1, 16)
    array[12345] = 7.0
    array[-1] = -1.0
    before = _rss_bytes()
    allocator.populate(array)
    assert _rss_bytes() - before > 0.9 * array.nbytes
    assert (array[12345] == 7.0).all() and (array[-1] == -1.0).all()
    assert np.count_nonzero(array) == 32
    allocator.populate(np.zeros(0, np.float32))  # nothing to do


def test_populate_refuses_what_it_cannot_write(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    monkeypatch.setattr(allocator, "_libc", lambda: None)
    array = np.zeros(1 << 16, np.float32)
    array.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        allocator.populate(array)


def test_reusable_buffers_hand_out_an_array_again_only_once_released() -> None:
    import numpy as np
    import torch

    pool = allocator.ReusableBuffers(keep=2)
    shape = (1024, 300)  # 1.2 MB: above REUSE_MIN_BYTES
    first = pool.empty(shape, np.float32)
    first[:] = 1.0
    second = pool.empty(shape, np.float32)  # the first is still held
    second[:] = 2.0
    assert not np.shares_memory(first, second) and (first == 1.0).all()
    address = first.__array_interface__["data"][0]
    del first
    third = pool.empty((1000, 300), np.float32)  # smaller: fits the released array
    assert third.__array_interface__["data"][0] == address and pool.reused == 1
    tensor = torch.from_numpy(third[::2])  # a tensor of a view keeps it busy
    del third
    fourth = pool.empty(shape, np.float32)
    assert not np.shares_memory(fourth, tensor.numpy())
    assert pool.empty((10, 10), np.float64).shape == (10, 10)  # small: plain np.empty, not cached
    assert len(pool._arrays) <= 2  # keep
    assert pool.empty((3, 4), np.int64).dtype == np.int64


RELEASE_SCRIPT = """
import ctypes, json, sys
from pathlib import Path
from psrec import allocator

def anonymous_rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
block = 1 << 20  # below the 32 MiB mmap threshold: from the heap
blocks = [libc.malloc(block) for _ in range(160)]
for address in blocks:
    ctypes.memset(address, 7, block)  # resident
kept = blocks[-1]  # the top block stays live: nothing at the heap's top to trim by itself
for address in blocks[:-1]:
    libc.free(address)
before = anonymous_rss()
released = allocator.release_free_memory()
after = anonymous_rss()
content = ctypes.string_at(kept, block)
print(json.dumps({"before": before, "after": after, "released": released, "intact": content == bytes([7]) * block}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_release_free_memory_gives_freed_heap_back_and_keeps_live_blocks() -> None:
    if allocator._libc() is None:
        pytest.skip("not glibc")
    import json

    # the CLI's settings, under which glibc keeps up to 1 GiB of freed heap (psrec.allocator)
    env = {**os.environ, **{name: str(value) for name, value in allocator.SETTINGS.items()}}
    done = subprocess.run(
        [sys.executable, "-c", RELEASE_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    figures = json.loads(done.stdout)
    assert figures["released"] is True and figures["intact"] is True
    # 159 MiB were freed and held by malloc; at least 150 MiB of it leaves the process
    assert figures["before"] - figures["after"] >= 150 << 20, figures


def test_release_drops_a_pools_free_arrays_and_keeps_busy_ones() -> None:
    import numpy as np

    pool = allocator.ReusableBuffers(keep=3)
    shape = (1024, 512)  # 2 MiB: above REUSE_MIN_BYTES
    busy = pool.empty(shape, np.float32)
    busy[:] = 3.0
    free = pool.empty(shape, np.float32)
    del free
    assert len(pool._arrays) == 2
    allocator.release_free_memory(pools=False)  # malloc's free memory only: the pool keeps both
    assert len(pool._arrays) == 2
    allocator.release_free_memory()  # every live pool: the free array goes, the busy one stays
    assert len(pool._arrays) == 1 and np.shares_memory(pool._arrays[0], busy)
    assert (busy == 3.0).all()
    assert pool.release_free() == 0  # nothing free left
    del busy
    assert pool.release_free() >= 1024 * 512 * 4 and pool._arrays == []
    allocated = pool.allocated
    pool.empty(shape, np.float32)  # a fresh array: nothing cached to reuse
    assert pool.allocated == allocated + 1
