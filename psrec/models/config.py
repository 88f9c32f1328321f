"""Validated model configuration, and the one builder that turns a config into its model.

A model config is one of the pydantic classes below, told apart by its ``name`` (a discriminated
union, `ModelConfig`); unknown keys are rejected. Each config names the model class it builds
(`model_class`) and declares which data-dependent sizes its constructor takes (``size_arguments``: number of
dense and sparse features, embedding dimension); every other field except ``name`` and ``dense_init``
is the constructor's keyword argument of the same name. The sizes are not part of the model config:
the trainer passes them to `build_model`, which maps the config to its model's constructor arguments::

    config = parse_model_config({"name": "dlrm", "top_hidden_sizes": [400, 400, 400]})
    model = build_model(config, num_dense=0, num_sparse=10, embedding_dim=10)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, TypeAdapter

if TYPE_CHECKING:
    from torch import nn

    from psrec.models.base import ClickThroughRateModel
    from psrec.models.hstu import HSTU
    from psrec.models.sasrec import SASRec

Activation = Literal["relu", "leaky_relu", "gelu", "tanh", "sigmoid", "prelu"]
Dropout = Annotated[float, Field(ge=0.0, lt=1.0)]
HiddenSizes = Annotated[list[PositiveInt], Field(min_length=1)]
SizeArgument = Literal["num_dense", "num_sparse", "embedding_dim"]
ALL_SIZES: tuple[SizeArgument, ...] = ("num_dense", "num_sparse", "embedding_dim")
# Config fields that configure the build itself rather than being constructor arguments.
BUILD_FIELDS = frozenset({"name", "dense_init"})


class _ModelConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Initial weights of the model's Linear layers: PyTorch's default (Kaiming-uniform, a=sqrt(5)) or
    # Xavier-normal weights with zero biases, as FuxiCTR/BARS initialise theirs.
    dense_init: Literal["torch", "xavier_normal"] = "torch"

    # The sizes (passed by `build_model`) the constructor of its model (`model_class`) takes.
    size_arguments: ClassVar[tuple[SizeArgument, ...]] = ALL_SIZES
    # Whether its model takes `ModelInput.linear` (the model class's own `uses_linear_terms`), known
    # without importing the model: the driver of a Ray run lays out the tables without torch.
    uses_linear_terms: ClassVar[bool] = False
    # Whether its model predicts the next item of interaction sequences (SASRec, HSTU): it trains on the
    # interactions format and is evaluated by ranking items (sampled candidates, or all of them).
    ranks_items: ClassVar[bool] = False
    # Whether its model has `stages()` (embedding, block stack, head), so that ps.pipeline can split it.
    has_stages: ClassVar[bool] = False


class LRConfig(_ModelConfigBase):
    name: Literal["lr"] = "lr"
    uses_linear_terms = True
    size_arguments = ("num_dense",)


class FMConfig(_ModelConfigBase):
    name: Literal["fm"] = "fm"
    uses_linear_terms = True
    size_arguments = ("num_dense", "embedding_dim")


class WideDeepConfig(_ModelConfigBase):
    name: Literal["wide_deep"] = "wide_deep"
    uses_linear_terms = True
    hidden_sizes: HiddenSizes = [400, 400, 400]
    activation: Activation = "relu"
    batch_norm: bool = False
    dropout: Dropout = 0.0


class DeepFMConfig(_ModelConfigBase):
    name: Literal["deepfm"] = "deepfm"
    uses_linear_terms = True
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
    has_stages = True
    target_feature_index: Annotated[int, Field(ge=0)]  # which pooled feature is the target item
    sequence_name: str = "history"
    max_length: PositiveInt = 50
    num_blocks: PositiveInt = 1
    num_heads: PositiveInt = 1
    dropout: Dropout = 0.1
    hidden_sizes: HiddenSizes = [1024, 512, 256]


class SASRecConfig(_ModelConfigBase):
    name: Literal["sasrec"] = "sasrec"
    size_arguments = ("embedding_dim",)
    ranks_items = True
    has_stages = True
    max_length: PositiveInt = 200
    num_blocks: PositiveInt = 2
    num_heads: PositiveInt = 1
    dropout: Dropout = 0.2
    # bce: one sampled negative per position (the paper's); sampled_softmax: cross-entropy over the
    # data schema's "negatives" sequence (N uniform items per user; N = its max_length).
    loss: Literal["bce", "sampled_softmax"] = "bce"
    # sampled_softmax: user = every position of a sequence scores its user's N negatives; position =
    # each position scores its own N, picked uniformly from the batch's B * N draws (the reference's).
    negatives_per: Literal["user", "position"] = "user"
    # dot: final layer norm and dot products (the paper's); cosine: L2-normalised user state and items
    # / temperature, no final norm (generative-recommenders' SASRec, its ML-1M configs: 0.05).
    similarity: Literal["dot", "cosine"] = "dot"
    temperature: PositiveFloat = 1.0


class HSTUConfig(_ModelConfigBase):
    """HSTU; the defaults are the reference's ML-1M settings (configs/ml-1m/hstu-sampled-softmax-n128-final.gin)."""

    name: Literal["hstu"] = "hstu"
    size_arguments = ("embedding_dim",)
    ranks_items = True
    has_stages = True
    max_length: PositiveInt = 200
    num_blocks: PositiveInt = 2
    num_heads: PositiveInt = 1
    attention_dim: PositiveInt = 50  # dqk, per head
    linear_dim: PositiveInt = 50  # dv, per head
    dropout: Dropout = 0.2  # on the input embeddings and on U * Norm(AV) (the reference sets both 0.2)
    temperature: PositiveFloat = 0.05  # logits = cosine / temperature
    # sampled_softmax (the reference's): the data schema's "negatives" (N items per user); bce: "neg".
    loss: Literal["bce", "sampled_softmax"] = "sampled_softmax"
    # user = every position of a sequence scores its user's N negatives; position = each position
    # scores its own N, picked uniformly from the batch's B * N draws (the reference's).
    negatives_per: Literal["user", "position"] = "user"
    # Run the blocks on the packed real tokens (psrec/models/jagged.py); false: on the padded batch,
    # the dense oracle (same weights, same results within float rounding, slower).
    jagged: bool = True


ModelConfig = Annotated[
    LRConfig
    | FMConfig
    | WideDeepConfig
    | DeepFMConfig
    | DCNv2Config
    | DLRMConfig
    | BSTConfig
    | SASRecConfig
    | HSTUConfig,
    Field(discriminator="name"),
]

_MODEL_CONFIG_ADAPTER: TypeAdapter[ModelConfig] = TypeAdapter(ModelConfig)


def parse_model_config(data: dict[str, Any]) -> ModelConfig:
    """Validate a plain mapping (from YAML/CLI) into a `ModelConfig`; raises pydantic.ValidationError."""
    return _MODEL_CONFIG_ADAPTER.validate_python(data)


def model_class(config: ModelConfig) -> type[ClickThroughRateModel] | type[SASRec] | type[HSTU]:
    """The model class `config` builds. The models are imported here, not with this module: a run's
    config is validated before torch is imported (`psrec train` starts its Ray cluster meanwhile)."""
    from psrec.models.bst import BehaviorSequenceTransformer
    from psrec.models.dcn import DCNv2
    from psrec.models.deepfm import DeepFM
    from psrec.models.dlrm import DLRM
    from psrec.models.fm import FactorizationMachineModel
    from psrec.models.hstu import HSTU
    from psrec.models.lr import LogisticRegression
    from psrec.models.sasrec import SASRec
    from psrec.models.wide_deep import WideAndDeep

    classes: dict[str, type[ClickThroughRateModel] | type[SASRec] | type[HSTU]] = {
        "lr": LogisticRegression,
        "fm": FactorizationMachineModel,
        "wide_deep": WideAndDeep,
        "deepfm": DeepFM,
        "dcn_v2": DCNv2,
        "dlrm": DLRM,
        "bst": BehaviorSequenceTransformer,
        "sasrec": SASRec,
        "hstu": HSTU,
    }
    return classes[config.name]


def uses_linear_terms(config: ModelConfig) -> bool:
    """Whether the model `config` describes needs ``ModelInput.linear`` (without importing it)."""
    return config.uses_linear_terms


def build_model(config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> nn.Module:
    """The model `config` describes, for data with these feature counts and embedding dimension.

    ``num_sparse`` counts the pooled features (``ModelInput.pooled.shape[1]``); SASRec and HSTU ignore it
    and ``num_dense``. Size mismatches the config cannot see (a BST target index beyond ``num_sparse``,
    heads not dividing ``embedding_dim``) raise ValueError here.
    """
    if num_dense < 0 or num_sparse < 0 or embedding_dim < 1:
        raise ValueError(
            f"build_model: need num_dense >= 0, num_sparse >= 0, embedding_dim >= 1; "
            f"got {num_dense}, {num_sparse}, {embedding_dim}"
        )
    if not isinstance(config, _ModelConfigBase):
        raise TypeError(f"build_model: not a model config: {type(config).__name__}")
    sizes: dict[str, int] = {"num_dense": num_dense, "num_sparse": num_sparse, "embedding_dim": embedding_dim}
    from torch import nn

    model = model_class(config)(**constructor_arguments(config, sizes))
    if config.dense_init == "xavier_normal":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_normal_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return model


def constructor_arguments(config: ModelConfig, sizes: dict[str, int]) -> dict[str, Any]:
    """The keyword arguments of `model_class(config)`: its sizes, then every non-build config field."""
    arguments: dict[str, Any] = {name: sizes[name] for name in config.size_arguments}
    arguments.update(config.model_dump(exclude=set(BUILD_FIELDS)))
    return arguments
