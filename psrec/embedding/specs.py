"""Plain, frozen configuration records for an embedding table.

Each spec is a small immutable dataclass that validates itself in ``__post_init__`` and can be turned
into a JSON-able dict (``as_dict``) and back (``from_dict``), which is how a table describes itself in
an exported state. Errors are ``ValueError`` with the field, the bad value and the allowed values.

Example::

    SparseOptimizerSpec("rowwise_adagrad", lr=0.05)
    InitializerSpec("uniform", scale=0.01)
    AdmissionSpec("min_count", min_count=3)
    EvictionSpec(ttl_steps=10_000, max_rows=50_000_000)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

OPTIMIZER_NAMES = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
INITIALIZER_KINDS = ("normal", "uniform", "zeros")
ADMISSION_KINDS = ("always", "min_count", "probability")
PRECISIONS = ("fp32", "fp16", "int8")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _finite_non_negative(name: str, value: float) -> None:
    _require(
        isinstance(value, int | float) and math.isfinite(value) and value >= 0,
        f"{name} must be a finite number >= 0, got {value!r}",
    )


@dataclass(frozen=True)
class SparseOptimizerSpec:
    """A sparse optimizer applied to the touched rows only.

    ``name`` is one of ``sgd``, ``adagrad`` (one accumulator per element, as ``torch.optim.Adagrad``),
    ``rowwise_adagrad`` (one accumulator per row: ``acc += mean(g**2)``), ``adam`` (lazy: moments and
    bias-correction step counted per row) or ``ftrl`` (FTRL-Proximal, McMahan et al. 2013, with
    ``lr`` as the per-coordinate learning-rate ``alpha`` and ``ftrl_beta``/``ftrl_l1``/``ftrl_l2``).

    ``eps`` defaults to 1e-8 for every optimizer (``torch.optim.Adagrad`` uses 1e-10; pass it to match
    exactly). ``weight_decay`` adds ``weight_decay * w`` to the gradient of touched rows (L2, as
    torch does); FTRL regularises through ``ftrl_l1``/``ftrl_l2`` instead and rejects it.
    ``initial_accumulator_value`` starts Adagrad accumulators and FTRL's ``n``.

    ``lazy=False`` steps every row of the table at each push to it, untouched rows with a zero
    gradient (plus ``weight_decay * w``), as ``torch.optim.Adam`` does for a dense ``nn.Embedding``:
    moments keep moving rows that were not in the batch and weight decay reaches the whole table.
    It costs O(table rows) per push, so it is meant for small tables (reproducing dense-optimizer
    results such as BARS/FuxiCTR); large tables want the default lazy update.
    """

    name: str
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator_value: float = 0.0
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0
    weight_decay: float = 0.0
    lazy: bool = True

    def __post_init__(self) -> None:
        _require(
            self.name in OPTIMIZER_NAMES,
            f"optimizer name must be one of {OPTIMIZER_NAMES}, got {self.name!r}",
        )
        _require(
            isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0,
            f"optimizer lr must be a finite number > 0, got {self.lr!r}",
        )
        _require(
            isinstance(self.eps, int | float) and math.isfinite(self.eps) and self.eps > 0,
            f"optimizer eps must be a finite number > 0, got {self.eps!r}",
        )
        for field in ("beta1", "beta2"):
            value = getattr(self, field)
            _require(
                isinstance(value, int | float) and 0.0 <= value < 1.0,
                f"optimizer {field} must be in [0, 1), got {value!r}",
            )
        for field in ("initial_accumulator_value", "ftrl_beta", "ftrl_l1", "ftrl_l2", "weight_decay"):
            _finite_non_negative(f"optimizer {field}", getattr(self, field))
        _require(isinstance(self.lazy, bool), f"optimizer lazy must be true or false, got {self.lazy!r}")
        _require(
            not (self.name == "ftrl" and self.weight_decay != 0.0),
            "optimizer 'ftrl' regularises with ftrl_l1/ftrl_l2; weight_decay must be 0",
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SparseOptimizerSpec:
        return cls(**values)  # specs saved before ``lazy`` existed default to the lazy update


@dataclass(frozen=True)
class InitializerSpec:
    """Initial value of a new row: ``normal(0, std)``, ``uniform(-scale, scale)`` or ``zeros``.

    The value is a pure function of (table seed, id, column), so an id gets the same initial row on
    any shard and in any order.
    """

    kind: str = "normal"
    std: float = 0.01
    scale: float = 0.05

    def __post_init__(self) -> None:
        _require(
            self.kind in INITIALIZER_KINDS,
            f"initializer kind must be one of {INITIALIZER_KINDS}, got {self.kind!r}",
        )
        _finite_non_negative("initializer std", self.std)
        _finite_non_negative("initializer scale", self.scale)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> InitializerSpec:
        return cls(**values)


@dataclass(frozen=True)
class AdmissionSpec:
    """When a new id gets a trainable row.

    ``always``: on first sight. ``min_count``: once a count-min sketch (``sketch_depth`` rows of
    ``sketch_width`` uint32 counters) has seen it ``min_count`` times in training pulls; the sketch may
    over-count (admit early), never under-count. ``probability``: each training pull admits a missing
    id with probability ``probability`` (a hash of seed, id and the table's pull counter).
    """

    kind: str = "always"
    min_count: int = 1
    probability: float = 1.0
    sketch_width: int = 1 << 20
    sketch_depth: int = 4

    def __post_init__(self) -> None:
        _require(
            self.kind in ADMISSION_KINDS,
            f"admission kind must be one of {ADMISSION_KINDS}, got {self.kind!r}",
        )
        _require(
            isinstance(self.min_count, int) and self.min_count >= 1,
            f"admission min_count must be an int >= 1, got {self.min_count!r}",
        )
        _require(
            isinstance(self.probability, int | float) and 0.0 <= self.probability <= 1.0,
            f"admission probability must be in [0, 1], got {self.probability!r}",
        )
        _require(
            isinstance(self.sketch_width, int) and 1 <= self.sketch_width < 2**31,
            f"admission sketch_width must be an int in [1, 2**31), got {self.sketch_width!r}",
        )
        _require(
            isinstance(self.sketch_depth, int) and 1 <= self.sketch_depth <= 16,
            f"admission sketch_depth must be an int in [1, 16], got {self.sketch_depth!r}",
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AdmissionSpec:
        return cls(**values)


@dataclass(frozen=True)
class EvictionSpec:
    """Which rows ``EmbeddingTable.evict`` removes.

    ``ttl_steps``: rows whose last update is more than ``ttl_steps`` steps before the ``step`` given
    to ``evict``. ``max_rows``: then the least frequently updated rows (ties: least recently updated,
    then lowest id) until at most ``max_rows`` remain. ``None`` disables a policy.
    """

    ttl_steps: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.ttl_steps is None or (isinstance(self.ttl_steps, int) and self.ttl_steps >= 0),
            f"eviction ttl_steps must be None or an int >= 0, got {self.ttl_steps!r}",
        )
        _require(
            self.max_rows is None or (isinstance(self.max_rows, int) and self.max_rows >= 0),
            f"eviction max_rows must be None or an int >= 0, got {self.max_rows!r}",
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EvictionSpec:
        return cls(**values)


# A coming pull's cold rows are read ahead while the table's last training pull promoted this many:
# for fewer, issuing the read costs more than the read it moves (docs/benchmarks.md, "Disk tier").
PREFETCH_MIN_ROWS = 256


@dataclass(frozen=True)
class StorageSpec:
    """A disk tier for a table (``psrec.embedding.tiered_table``): at most ``memory_rows`` rows in
    memory, the others in a file under ``disk_dir``."""

    memory_rows: int
    disk_dir: str
    prefetch_min_rows: int = PREFETCH_MIN_ROWS  # see `TieredTable.prefetch_min_rows`

    def __post_init__(self) -> None:
        _require(
            isinstance(self.memory_rows, int)
            and not isinstance(self.memory_rows, bool)
            and self.memory_rows >= 1,
            f"storage memory_rows must be an int >= 1, got {self.memory_rows!r}",
        )
        _require(
            isinstance(self.disk_dir, str) and bool(self.disk_dir),
            f"storage disk_dir must be a non-empty path, got {self.disk_dir!r}",
        )
        _require(
            isinstance(self.prefetch_min_rows, int)
            and not isinstance(self.prefetch_min_rows, bool)
            and self.prefetch_min_rows >= 0,
            f"storage prefetch_min_rows must be an int >= 0, got {self.prefetch_min_rows!r}",
        )


@dataclass(frozen=True)
class TableSpec:
    """Everything that builds one `EmbeddingTable`: plain data, so it travels to a shard process.

    ``initial_rows`` reserves that many rows up front (and ``populate`` backs them with memory);
    ``seed`` fixes the initial value of every row by id; ``storage`` adds a disk tier.
    """

    name: str
    dim: int
    optimizer: SparseOptimizerSpec
    initializer: InitializerSpec = InitializerSpec()  # noqa: B008 - frozen dataclass
    precision: str = "fp32"
    stochastic_rounding: bool = False
    admission: AdmissionSpec = AdmissionSpec()  # noqa: B008
    eviction: EvictionSpec = EvictionSpec()  # noqa: B008
    seed: int = 0
    initial_rows: int = 0
    populate: bool = True
    storage: StorageSpec | None = None
