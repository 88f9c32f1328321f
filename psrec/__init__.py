"""psrec: parameter-server training of recommendation models with huge, growing embedding tables.

Importing psrec has no side effects: no logging setup, no Ray start.
"""

from psrec.data.batch import Batch, PaddedSequence, SparseBatch
from psrec.models.base import ModelInput

__all__ = ["Batch", "ModelInput", "PaddedSequence", "SparseBatch"]
__version__ = "0.1.0"
