"""``prefetch(array, index)``: a numba intrinsic emitting LLVM's ``llvm.prefetch`` for one element.

Random access into tables far larger than the caches (hash slots, stored ids, rows) is bound by
memory latency, not bandwidth. The batch kernels issue prefetches for the next few elements before
using the current one, so many cache misses are in flight at once. A prefetch never faults and has
no visible effect, so every kernel gives the same results with or without it (the tests compare the
kernels against plain references either way).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE_BYTES = 64


@intrinsic
def _prefetch_intrinsic(typing_context, array, index):  # pragma: no cover - compiled by numba
    """Hint that ``array[index]`` (1-D, or the start of row ``index`` of a 2-D array) will be read soon."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None
    return types.void(array, index), _prefetch_codegen


@intrinsic
def _prefetch_element_intrinsic(typing_context, array, row, column):  # pragma: no cover - compiled by numba
    """Hint that ``array[row, column]`` of a 2-D array will be read soon."""
    if not isinstance(array, types.Array) or array.ndim != 2:
        return None
    return types.void(array, row, column), _prefetch_codegen


# Typed names for callers (mypy sees the intrinsics' typing signature otherwise).
prefetch: Callable[..., None] = _prefetch_intrinsic
prefetch_element: Callable[..., None] = _prefetch_element_intrinsic


@numba.njit(cache=True, nogil=True, inline="always")
def prefetch_row(array, row):  # pragma: no cover - numba
    """Prefetch every cache line of row ``row`` of a C-contiguous 2-D array."""
    step = max(1, CACHE_LINE_BYTES // array.itemsize)
    for column in range(0, array.shape[1], step):
        prefetch_element(array, row, column)


def _prefetch_codegen(context, builder, signature, arguments):  # pragma: no cover - numba code generation
    array_type = signature.args[0]
    array_value = context.make_array(array_type)(context, builder, arguments[0])
    indices = [
        context.cast(builder, value, value_type, types.intp)
        for value, value_type in zip(arguments[1:], signature.args[1:], strict=True)
    ]
    indices += [context.get_constant(types.intp, 0)] * (array_type.ndim - len(indices))
    pointer = cgutils.get_item_pointer(context, builder, array_type, array_value, indices, wraparound=False)
    int32 = ir.IntType(32)
    opaque = ir.PointerType()
    function_type = ir.FunctionType(ir.VoidType(), [opaque, int32, int32, int32])
    function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.prefetch.p0")
    # read (0), high temporal locality (3), data cache (1)
    builder.call(
        function,
        [
            builder.bitcast(pointer, opaque),
            ir.Constant(int32, 0),
            ir.Constant(int32, 3),
            ir.Constant(int32, 1),
        ],
    )
    return context.get_dummy_value()
