"""psrec models: they take a `ModelInput` (embeddings already pulled from the parameter server).

See `psrec.models.base` for the training contract (`loss`, `predict`, `uses_linear_terms`, `stages`).
The names below load their module (and torch) when first used: `psrec.models.config` validates a
run's model config without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psrec.models.base import ClickThroughRateModel, ModelInput, ModelStages, RecommendationModel
    from psrec.models.bst import BehaviorSequenceTransformer
    from psrec.models.config import ModelConfig, build_model, parse_model_config
    from psrec.models.dcn import DCNv2
    from psrec.models.deepfm import DeepFM
    from psrec.models.dlrm import DLRM
    from psrec.models.fm import FactorizationMachineModel
    from psrec.models.hstu import HSTU
    from psrec.models.lr import LogisticRegression
    from psrec.models.sasrec import SASRec
    from psrec.models.wide_deep import WideAndDeep

_EXPORTS = {
    "ClickThroughRateModel": "psrec.models.base",
    "ModelInput": "psrec.models.base",
    "ModelStages": "psrec.models.base",
    "RecommendationModel": "psrec.models.base",
    "BehaviorSequenceTransformer": "psrec.models.bst",
    "ModelConfig": "psrec.models.config",
    "build_model": "psrec.models.config",
    "parse_model_config": "psrec.models.config",
    "DCNv2": "psrec.models.dcn",
    "DeepFM": "psrec.models.deepfm",
    "DLRM": "psrec.models.dlrm",
    "FactorizationMachineModel": "psrec.models.fm",
    "HSTU": "psrec.models.hstu",
    "LogisticRegression": "psrec.models.lr",
    "SASRec": "psrec.models.sasrec",
    "WideAndDeep": "psrec.models.wide_deep",
}

__all__ = [
    "DLRM",
    "HSTU",
    "BehaviorSequenceTransformer",
    "ClickThroughRateModel",
    "DCNv2",
    "DeepFM",
    "FactorizationMachineModel",
    "LogisticRegression",
    "ModelConfig",
    "ModelInput",
    "ModelStages",
    "RecommendationModel",
    "SASRec",
    "WideAndDeep",
    "build_model",
    "parse_model_config",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'psrec.models' has no attribute {name!r}")
