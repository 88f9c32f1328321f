"""grow_rows: in-place growth keeps contents and zero-fills; views fall back to a copy; large arrays
move once to memory advised for transparent huge pages."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from psrec.embedding import arrays
from psrec.embedding.arrays import grow_rows


def test_grows_in_place_and_zero_fills() -> None:
    array = np.arange(12, dtype=np.float32).reshape(6, 2).copy()
    grown = grow_rows(array, 10)
    assert grown is array and grown.shape == (10, 2)
    np.testing.assert_array_equal(grown[:6], np.arange(12).reshape(6, 2))
    assert not grown[6:].any()
    assert grow_rows(grown, 4) is grown


def test_views_are_copied_not_resized() -> None:
    base = np.arange(20, dtype=np.int64)
    view = base[:10]
    grown = grow_rows(view, 15)
    assert grown is not view and grown.shape == (15,)
    np.testing.assert_array_equal(grown[:10], np.arange(10))
    np.testing.assert_array_equal(base, np.arange(20))


def test_an_array_growing_large_moves_to_memory_advised_for_huge_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    advised: list[int] = []
    monkeypatch.setattr(arrays, "HUGE_PAGE_BYTES", 1024)
    monkeypatch.setattr(arrays, "advise_huge_pages", lambda a: advised.append(a.nbytes) or True)
    array = np.arange(40, dtype=np.float64).reshape(20, 2).copy()  # 320 bytes
    grown = arrays.grow_rows(array, 100)  # 1600 bytes: crosses the threshold
    assert grown is not array and grown.shape == (100, 2) and advised == [1600]
    np.testing.assert_array_equal(grown[:20], np.arange(40).reshape(20, 2))
    assert not grown[20:].any()
    again = arrays.grow_rows(grown, 150)  # already large: grows in place (realloc keeps the advice)
    assert again is grown and advised == [1600]
    np.testing.assert_array_equal(again[:20], np.arange(40).reshape(20, 2))
    assert not again[20:].any()


def _vm_flags(address: int) -> list[str] | None:
    """VmFlags of the mapping holding `address` (Linux /proc/self/smaps), None if not readable."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_large_tables_get_the_kernels_huge_page_flag_where_thp_is_available() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages here")
    from psrec.allocator import advise_huge_pages

    if not advise_huge_pages(np.empty(1 << 20, np.uint8)):
        pytest.skip("madvise(MADV_HUGEPAGE) refused here")
    grown = arrays.grow_rows(np.zeros((1, 1024), np.float32), 16 * 1024)  # 64 MiB
    flags = _vm_flags(grown.ctypes.data + grown.nbytes // 2)
    if flags is None:
        pytest.skip("/proc/self/smaps not readable")
    assert "hg" in flags  # MADV_HUGEPAGE recorded on the mapping
