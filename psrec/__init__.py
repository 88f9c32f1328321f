"""psrec: parameter-server training of recommendation models with huge, growing embedding tables.

Importing psrec has no side effects: no logging setup, no Ray start, and not even an import of
torch until one of the names below is used (the CLI sets thread policies before torch loads).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psrec.config import RunConfig, load_config
    from psrec.data.batch import Batch, PaddedSequence, SparseBatch
    from psrec.embedding import EmbeddingTable
    from psrec.models.base import ModelInput
    from psrec.train.loop import train

_EXPORTS = {
    "Batch": "psrec.data.batch",
    "PaddedSequence": "psrec.data.batch",
    "SparseBatch": "psrec.data.batch",
    "ModelInput": "psrec.models.base",
    "EmbeddingTable": "psrec.embedding",
    "RunConfig": "psrec.config",
    "load_config": "psrec.config",
    "train": "psrec.train.loop",
}

__all__ = [
    "Batch",
    "EmbeddingTable",
    "ModelInput",
    "PaddedSequence",
    "RunConfig",
    "SparseBatch",
    "load_config",
    "train",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'psrec' has no attribute {name!r}")
