"""psrec's input pipeline: schema, feature hashing, format readers, sharded resumable batches.

Public names (imported lazily, so `import psrec` stays cheap): `Schema`, `DenseFeature`,
`SparseFeature`, `SequenceFeature`, `DataSource`, `open_reader`, `BatchReader`, `hash_values`,
`write_synthetic_criteo`, `criteo_schema`, `BadRowError`, `load_interactions`, `evaluation_batches`,
`sasrec_schema`, `convert_to_parquet`, and the Kafka stream source: `KafkaSource`, `open_kafka_reader`,
`partitions_for`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Schema": "psrec.data.schema",
    "DenseFeature": "psrec.data.schema",
    "SparseFeature": "psrec.data.schema",
    "SequenceFeature": "psrec.data.schema",
    "DataSource": "psrec.data.schema",
    "open_reader": "psrec.data.reader",
    "BatchReader": "psrec.data.reader",
    "hash_values": "psrec.data.feature_hashing",
    "write_synthetic_criteo": "psrec.data.synth",
    "criteo_schema": "psrec.data.synth",
    "BadRowError": "psrec.data.errors",
    "load_interactions": "psrec.data.sequences",
    "evaluation_batches": "psrec.data.sequences",
    "sasrec_schema": "psrec.data.sequences",
    "convert_to_parquet": "psrec.data.convert",
    "KafkaSource": "psrec.data.kafka_source",
    "open_kafka_reader": "psrec.data.kafka_source",
    "partitions_for": "psrec.data.kafka_source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'psrec.data' has no attribute {name!r}")
