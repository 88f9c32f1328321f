"""The tag and the seed of a hashing namespace (`psrec.data.feature_hashing` has the id layout).

Plain Python, apart from the hashing kernels: a run's config validates its schema's namespaces
(`psrec.data.schema`) without importing numba, so `psrec train` starts its Ray cluster sooner.
"""

from __future__ import annotations

import hashlib

NUM_TAGS = (1 << 15) - 1


def namespace_tag(namespace: str) -> int:
    """The 15-bit tag in [1, 32767] that occupies bits 48-62 of every id hashed in `namespace`."""
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=8, person=b"psrec-tag").digest()
    return 1 + int.from_bytes(digest, "little") % NUM_TAGS


def namespace_seed(namespace: str) -> int:
    """The 64-bit FNV-1a starting state for values hashed in `namespace`."""
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=8, person=b"psrec-seed").digest()
    return int.from_bytes(digest, "little")
