"""Plain-Python/NumPy reference implementations: the test oracles of the numba fast paths.

Nothing here is fast or used in production. ``ReferenceTable`` is an ``EmbeddingTable`` written as a
dict of rows with one optimizer step per row in straightforward NumPy (``reference_step``), fp16
storage through ``np.float16`` casts and int8 through ``int8_round_trip_numpy``. Property tests run
random operation sequences on both and compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from psrec.embedding.initializers import initial_rows_numpy
from psrec.embedding.specs import AdmissionSpec, EvictionSpec, InitializerSpec, SparseOptimizerSpec

INT8_LEVELS = 255.0


def int8_round_trip_numpy(values: np.ndarray) -> np.ndarray:
    """Encode (round to nearest) and decode rows of ``values`` with per-row scale/offset."""
    values = values.astype(np.float32)
    low = values.min(axis=1, keepdims=True)
    high = values.max(axis=1, keepdims=True)
    scale = ((high - low) / np.float32(INT8_LEVELS)).astype(np.float32)
    safe_scale = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(np.floor((values - low) / safe_scale + np.float32(0.5)), 0, INT8_LEVELS)
    codes = np.where(scale == 0, 0, codes).astype(np.float32)
    return (codes * scale + low).astype(np.float32)


def round_trip_numpy(values: np.ndarray, precision: str) -> np.ndarray:
    """``values`` as read back after a round-to-nearest store at ``precision``."""
    if precision == "fp32":
        return values.astype(np.float32)
    if precision == "fp16":
        return values.astype(np.float16).astype(np.float32)
    return int8_round_trip_numpy(values)


def new_state(spec: SparseOptimizerSpec, dim: int) -> dict[str, np.ndarray]:
    """Optimizer state of a fresh row."""
    start = np.float32(spec.initial_accumulator_value)
    if spec.name == "adagrad":
        return {"accumulator": np.full(dim, start, np.float32)}
    if spec.name == "rowwise_adagrad":
        return {"accumulator": np.full(1, start, np.float32)}
    if spec.name == "adam":
        return {
            "exp_avg": np.zeros(dim, np.float32),
            "exp_avg_sq": np.zeros(dim, np.float32),
            "step": np.zeros(1),
        }
    if spec.name == "ftrl":
        return {"z": np.zeros(dim, np.float32), "n": np.full(dim, start, np.float32)}
    return {}


def reference_step(
    spec: SparseOptimizerSpec, weight: np.ndarray, state: dict[str, np.ndarray], grad: np.ndarray
) -> np.ndarray:
    """One optimizer step on one row (float64 math); updates ``state`` in place, returns the new row."""
    w = weight.astype(np.float64)
    g = grad.astype(np.float64)
    if spec.name != "ftrl":
        g = g + spec.weight_decay * w
    if spec.name == "sgd":
        w = w - spec.lr * g
    elif spec.name == "adagrad":
        state["accumulator"] = state["accumulator"] + g * g
        w = w - spec.lr * g / (np.sqrt(state["accumulator"]) + spec.eps)
    elif spec.name == "rowwise_adagrad":
        state["accumulator"] = state["accumulator"] + np.mean(g * g)
        w = w - spec.lr * g / (np.sqrt(state["accumulator"]) + spec.eps)
    elif spec.name == "adam":
        state["step"] = state["step"] + 1
        t = float(state["step"][0])
        state["exp_avg"] = spec.beta1 * state["exp_avg"] + (1 - spec.beta1) * g
        state["exp_avg_sq"] = spec.beta2 * state["exp_avg_sq"] + (1 - spec.beta2) * g * g
        m_hat = state["exp_avg"] / (1 - spec.beta1**t)
        v_hat = state["exp_avg_sq"] / (1 - spec.beta2**t)
        w = w - spec.lr * m_hat / (np.sqrt(v_hat) + spec.eps)
    else:
        n = state["n"].astype(np.float64)
        new_n = n + g * g
        sigma = (np.sqrt(new_n) - np.sqrt(n)) / spec.lr
        state["z"] = state["z"] + g - sigma * w
        state["n"] = new_n
        z = state["z"]
        shrunk = -(z - np.sign(z) * spec.ftrl_l1) / (
            (spec.ftrl_beta + np.sqrt(new_n)) / spec.lr + spec.ftrl_l2
        )
        w = np.where(np.abs(z) <= spec.ftrl_l1, 0.0, shrunk)
    return w


@dataclass
class ReferenceRow:
    value: np.ndarray  # (dim,) float32 as read back from storage
    state: dict[str, np.ndarray]
    count: int = 0
    last_step: int = 0


@dataclass
class ReferenceTable:
    """Dict-of-rows oracle of ``EmbeddingTable`` (admission ``always`` or ``min_count`` with an exact
    counter; no stochastic rounding)."""

    dim: int
    optimizer: SparseOptimizerSpec
    initializer: InitializerSpec = field(default_factory=InitializerSpec)
    precision: str = "fp32"
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)
    eviction: EvictionSpec = field(default_factory=EvictionSpec)
    seed: int = 0
    rows: dict[int, ReferenceRow] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    clock: int = 0

    def initial(self, ids: np.ndarray) -> np.ndarray:
        return round_trip_numpy(
            initial_rows_numpy(ids, self.dim, self.initializer, self.seed), self.precision
        )

    def pull(self, ids: np.ndarray, *, train: bool = True) -> np.ndarray:
        out = self.initial(ids)
        for position, key in enumerate(ids.tolist()):
            if key not in self.rows and train:
                self.seen[key] = self.seen.get(key, 0) + 1
                if self.admission.kind == "always" or self.seen[key] >= self.admission.min_count:
                    self.rows[key] = ReferenceRow(
                        out[position].copy(), new_state(self.optimizer, self.dim), 0, self.clock
                    )
            if key in self.rows:
                out[position] = self.rows[key].value
        return out

    def push(self, ids: np.ndarray, grads: np.ndarray, *, step: int) -> None:
        self.clock = max(self.clock, step)
        summed: dict[int, np.ndarray] = {}
        occurrences: dict[int, int] = {}
        for key, grad in zip(ids.tolist(), grads, strict=True):
            if key in self.rows:
                summed[key] = summed.get(key, np.zeros(self.dim, np.float32)) + grad
                occurrences[key] = occurrences.get(key, 0) + 1
        for key, grad in summed.items():
            row = self.rows[key]
            updated = reference_step(self.optimizer, row.value, row.state, grad)
            row.value = round_trip_numpy(updated[None, :], self.precision)[0]
            row.count += occurrences[key]
            row.last_step = self.clock

    def remove(self, ids: np.ndarray) -> int:
        removed = 0
        for key in ids.tolist():
            if self.rows.pop(key, None) is not None:
                removed += 1
        return removed

    def evict(self, *, step: int) -> int:
        keys = list(self.rows)
        victims = set()
        if self.eviction.ttl_steps is not None:
            victims = {key for key in keys if step - self.rows[key].last_step > self.eviction.ttl_steps}
        if self.eviction.max_rows is not None:
            survivors = sorted(
                (key for key in keys if key not in victims),
                key=lambda key: (self.rows[key].count, self.rows[key].last_step, key),
            )
            excess = len(survivors) - self.eviction.max_rows
            victims |= set(survivors[: max(excess, 0)])
        for key in victims:
            del self.rows[key]
        return len(victims)
