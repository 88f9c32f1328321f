"""psrec models: they take a `ModelInput` (embeddings already pulled from the parameter server).

See `psrec.models.base` for the training contract (`loss`, `predict`, `uses_linear_terms`, `stages`).
"""

from psrec.models.base import ClickThroughRateModel, ModelInput, ModelStages, RecommendationModel
from psrec.models.bst import BehaviorSequenceTransformer
from psrec.models.config import ModelConfig, build_model, parse_model_config
from psrec.models.dcn import DCNv2
from psrec.models.deepfm import DeepFM
from psrec.models.dlrm import DLRM
from psrec.models.fm import FactorizationMachineModel
from psrec.models.lr import LogisticRegression
from psrec.models.sasrec import SASRec
from psrec.models.wide_deep import WideAndDeep

__all__ = [
    "DLRM",
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
