"""Validated model configuration and the one explicit builder per model.

A model config is one of the pydantic classes below, told apart by its ``name`` (a discriminated
union, `ModelConfig`); unknown keys are rejected. The data-dependent sizes (number of dense and sparse
features, embedding dimension) are not part of the model config: the trainer passes them to
`build_model`, which maps each config to its model's constructor arguments::

    config = parse_model_config({"name": "dlrm", "top_hidden_sizes": [400, 400, 400]})
    model = build_model(config, num_dense=0, num_sparse=10, embedding_dim=10)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, TypeAdapter
from torch import nn

from psrec.models.bst import BehaviorSequenceTransformer
from psrec.models.dcn import DCNv2
from psrec.models.deepfm import DeepFM
from psrec.models.dlrm import DLRM
from psrec.models.fm import FactorizationMachineModel
from psrec.models.lr import LogisticRegression
from psrec.models.sasrec import SASRec
from psrec.models.wide_deep import WideAndDeep

Activation = Literal["relu", "leaky_relu", "gelu", "tanh", "sigmoid", "prelu"]
Dropout = Annotated[float, Field(ge=0.0, lt=1.0)]
HiddenSizes = Annotated[list[PositiveInt], Field(min_length=1)]


class _ModelConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Initial weights of the model's Linear layers: PyTorch's default (Kaiming-uniform, a=sqrt(5)) or
    # Xavier-normal weights with zero biases, as FuxiCTR/BARS initialise theirs.
    dense_init: Literal["torch", "xavier_normal"] = "torch"


class LRConfig(_ModelConfigBase):
    name: Literal["lr"] = "lr"


class FMConfig(_ModelConfigBase):
    name: Literal["fm"] = "fm"


class WideDeepConfig(_ModelConfigBase):
    name: Literal["wide_deep"] = "wide_deep"
    hidden_sizes: HiddenSizes = [400, 400, 400]
    activation: Activation = "relu"
    batch_norm: bool = False
    dropout: Dropout = 0.0


class DeepFMConfig(_ModelConfigBase):
    name: Literal["deepfm"] = "deepfm"
    hidden_sizes: HiddenSizes = [400, 400, 400]
    activation: Activation = "relu"
    batch_norm: bool = True
    dropout: Dropout = 0.2


class DCNv2Config(_ModelConfigBase):
    name: Literal["dcn_v2"] = "dcn_v2"
    structure: Literal["crossnet_only", "stacked", "parallel", "stacked_parallel"] = "parallel"
    num_cross_layers: PositiveInt = 4
    low_rank: PositiveInt | None = None
    hidden_sizes: HiddenSizes = [400, 400, 400]
    activation: Activation = "relu"
    batch_norm: bool = False
    dropout: Dropout = 0.0


class DLRMConfig(_ModelConfigBase):
    name: Literal["dlrm"] = "dlrm"
    bottom_hidden_sizes: list[PositiveInt] = [64]  # the last bottom layer (== embedding_dim) is added
    top_hidden_sizes: HiddenSizes = [400, 400, 400]
    activation: Activation = "relu"
    batch_norm: bool = False
    dropout: Dropout = 0.0
    interaction: Literal["dot", "cat"] = "dot"  # cat: FuxiCTR's interaction_op cat (BARS Frappe)


class BSTConfig(_ModelConfigBase):
    name: Literal["bst"] = "bst"
    target_feature_index: Annotated[int, Field(ge=0)]  # which pooled feature is the target item
    sequence_name: str = "history"
    max_length: PositiveInt = 50
    num_blocks: PositiveInt = 1
    num_heads: PositiveInt = 1
    dropout: Dropout = 0.1
    hidden_sizes: HiddenSizes = [1024, 512, 256]


class SASRecConfig(_ModelConfigBase):
    name: Literal["sasrec"] = "sasrec"
    max_length: PositiveInt = 200
    num_blocks: PositiveInt = 2
    num_heads: PositiveInt = 1
    dropout: Dropout = 0.2


ModelConfig = Annotated[
    LRConfig | FMConfig | WideDeepConfig | DeepFMConfig | DCNv2Config | DLRMConfig | BSTConfig | SASRecConfig,
    Field(discriminator="name"),
]

_MODEL_CONFIG_ADAPTER: TypeAdapter[ModelConfig] = TypeAdapter(ModelConfig)


def parse_model_config(data: dict[str, Any]) -> ModelConfig:
    """Validate a plain mapping (from YAML/CLI) into a `ModelConfig`; raises pydantic.ValidationError."""
    return _MODEL_CONFIG_ADAPTER.validate_python(data)


def build_lr(config: LRConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> LogisticRegression:
    return LogisticRegression(num_dense)


def build_fm(
    config: FMConfig, *, num_dense: int, num_sparse: int, embedding_dim: int
) -> FactorizationMachineModel:
    return FactorizationMachineModel(num_dense, embedding_dim)


def build_wide_deep(
    config: WideDeepConfig, *, num_dense: int, num_sparse: int, embedding_dim: int
) -> WideAndDeep:
    return WideAndDeep(
        num_dense,
        num_sparse,
        embedding_dim,
        hidden_sizes=config.hidden_sizes,
        activation=config.activation,
        batch_norm=config.batch_norm,
        dropout=config.dropout,
    )


def build_deepfm(config: DeepFMConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> DeepFM:
    return DeepFM(
        num_dense,
        num_sparse,
        embedding_dim,
        hidden_sizes=config.hidden_sizes,
        activation=config.activation,
        batch_norm=config.batch_norm,
        dropout=config.dropout,
    )


def build_dcn_v2(config: DCNv2Config, *, num_dense: int, num_sparse: int, embedding_dim: int) -> DCNv2:
    return DCNv2(
        num_dense,
        num_sparse,
        embedding_dim,
        structure=config.structure,
        num_cross_layers=config.num_cross_layers,
        low_rank=config.low_rank,
        hidden_sizes=config.hidden_sizes,
        activation=config.activation,
        batch_norm=config.batch_norm,
        dropout=config.dropout,
    )


def build_dlrm(config: DLRMConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> DLRM:
    return DLRM(
        num_dense,
        num_sparse,
        embedding_dim,
        bottom_hidden_sizes=config.bottom_hidden_sizes,
        top_hidden_sizes=config.top_hidden_sizes,
        activation=config.activation,
        batch_norm=config.batch_norm,
        dropout=config.dropout,
        interaction=config.interaction,
    )


def build_bst(
    config: BSTConfig, *, num_dense: int, num_sparse: int, embedding_dim: int
) -> BehaviorSequenceTransformer:
    return BehaviorSequenceTransformer(
        num_dense,
        num_sparse,
        embedding_dim,
        target_feature_index=config.target_feature_index,
        sequence_name=config.sequence_name,
        max_length=config.max_length,
        num_blocks=config.num_blocks,
        num_heads=config.num_heads,
        dropout=config.dropout,
        hidden_sizes=config.hidden_sizes,
    )


def build_sasrec(config: SASRecConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> SASRec:
    return SASRec(
        embedding_dim,
        max_length=config.max_length,
        num_blocks=config.num_blocks,
        num_heads=config.num_heads,
        dropout=config.dropout,
    )


def uses_linear_terms(config: ModelConfig) -> bool:
    """Whether the model `config` describes needs ``ModelInput.linear`` (without building it)."""
    return isinstance(config, LRConfig | FMConfig | WideDeepConfig | DeepFMConfig)


def build_model(config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> nn.Module:
    """The model `config` describes, for data with these feature counts and embedding dimension.

    ``num_sparse`` counts the pooled features (``ModelInput.pooled.shape[1]``); SASRec ignores it and
    ``num_dense``. Size mismatches the config cannot see (a BST target index beyond ``num_sparse``,
    heads not dividing ``embedding_dim``) raise ValueError here.
    """
    if num_dense < 0 or num_sparse < 0 or embedding_dim < 1:
        raise ValueError(
            f"build_model: need num_dense >= 0, num_sparse >= 0, embedding_dim >= 1; "
            f"got {num_dense}, {num_sparse}, {embedding_dim}"
        )
    sizes: dict[str, int] = {"num_dense": num_dense, "num_sparse": num_sparse, "embedding_dim": embedding_dim}
    model = _build(config, sizes)
    if config.dense_init == "xavier_normal":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_normal_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return model


def _build(config: ModelConfig, sizes: dict[str, int]) -> nn.Module:
    match config:
        case LRConfig():
            return build_lr(config, **sizes)
        case FMConfig():
            return build_fm(config, **sizes)
        case WideDeepConfig():
            return build_wide_deep(config, **sizes)
        case DeepFMConfig():
            return build_deepfm(config, **sizes)
        case DCNv2Config():
            return build_dcn_v2(config, **sizes)
        case DLRMConfig():
            return build_dlrm(config, **sizes)
        case BSTConfig():
            return build_bst(config, **sizes)
        case SASRecConfig():
            return build_sasrec(config, **sizes)
    raise TypeError(f"build_model: not a model config: {type(config).__name__}")
