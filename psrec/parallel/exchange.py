"""Variable-sized all-to-all of NumPy arrays over `torch.distributed` (gloo on CPU, NCCL on GPUs).

`all_to_all_arrays(parts)` sends ``parts[r]`` to rank r and returns the arrays every rank sent to this
one, in rank order. The sizes travel first (one small `all_to_all_single` of counts), then the data in
one `all_to_all_single` with uneven splits. gloo implements `all_to_all_single` with uneven splits
on CPU (checked with torch 2.13), so no all_gather or send/recv fallback is needed.

With a single rank the exchange is a copy-free identity and needs no process group, so the
collective code paths also run (and are unit-tested) in one plain process.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def exchange_counts(counts: np.ndarray, group: dist.ProcessGroup | None = None) -> np.ndarray:
    """counts (W, K) int64, row r for rank r -> (W, K): row r is what rank r sent this rank."""
    if counts.shape[0] == 1:
        return counts.copy()
    sent = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64)).reshape(-1)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return received.numpy().reshape(counts.shape)


def all_to_all_flat(
    parts: list[np.ndarray], received_sizes: list[int], group: dist.ProcessGroup | None = None
) -> list[np.ndarray]:
    """Exchange 1-D arrays of one dtype whose received sizes are already known (e.g. from counts)."""
    if len(parts) == 1:
        return [parts[0]]
    dtype = parts[0].dtype
    sent = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype))
    received = torch.empty(sum(received_sizes), dtype=sent.dtype)
    dist.all_to_all_single(
        received,
        sent,
        output_split_sizes=list(received_sizes),
        input_split_sizes=[p.size for p in parts],
        group=group,
    )
    out = received.numpy()
    bounds = np.cumsum([0, *received_sizes])
    return [out[bounds[r] : bounds[r + 1]] for r in range(len(received_sizes))]


def all_to_all_arrays(parts: list[np.ndarray], group: dist.ProcessGroup | None = None) -> list[np.ndarray]:
    """Send ``parts[r]`` (1-D, one dtype on every rank) to rank r; return what each rank sent here."""
    counts = exchange_counts(np.array([[p.size] for p in parts], dtype=np.int64), group)
    return all_to_all_flat(parts, [int(c) for c in counts[:, 0]], group)
