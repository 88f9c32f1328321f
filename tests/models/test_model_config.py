import inspect
import subprocess
import sys
import typing

import pytest
import torch
from pydantic import ValidationError

from psrec.models import (
    DLRM,
    HSTU,
    BehaviorSequenceTransformer,
    DCNv2,
    DeepFM,
    FactorizationMachineModel,
    LogisticRegression,
    SASRec,
    WideAndDeep,
    build_model,
    parse_model_config,
)
from psrec.models.config import (
    ALL_SIZES,
    BUILD_FIELDS,
    DCNv2Config,
    DLRMConfig,
    ModelConfig,
    constructor_arguments,
    model_class,
    uses_linear_terms,
)

EXPECTED = {
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


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_name_builds_its_model(name: str) -> None:
    data: dict[str, object] = {"name": name}
    if name == "bst":
        data["target_feature_index"] = 1
    model = build_model(parse_model_config(data), num_dense=3, num_sparse=4, embedding_dim=10)
    assert type(model) is EXPECTED[name]
    assert model.uses_linear_terms is uses_linear_terms(parse_model_config(data))


CONFIG_CLASSES = typing.get_args(typing.get_args(ModelConfig)[0])


def test_next_item_and_staged_models_are_declared_by_their_configs() -> None:
    ranking = {c.model_fields["name"].default for c in CONFIG_CLASSES if c.ranks_items}
    staged = {c.model_fields["name"].default for c in CONFIG_CLASSES if c.has_stages}
    assert ranking == {"sasrec", "hstu"}
    assert staged == {"bst", "sasrec", "hstu"}
    for name in staged:
        data: dict[str, object] = {"name": name, **({"target_feature_index": 0} if name == "bst" else {})}
        model = build_model(parse_model_config(data), num_dense=0, num_sparse=2, embedding_dim=10)
        assert callable(getattr(model, "stages", None))


def test_hstu_defaults_are_the_references_ml1m_settings() -> None:
    config = parse_model_config({"name": "hstu"})
    assert (config.max_length, config.num_blocks, config.num_heads) == (200, 2, 1)  # type: ignore[union-attr]
    assert (config.attention_dim, config.linear_dim, config.dropout) == (50, 50, 0.2)  # type: ignore[union-attr]
    assert (config.temperature, config.loss) == (0.05, "sampled_softmax")  # type: ignore[union-attr]


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_config_fields_are_exactly_the_constructor_arguments(config_class: typing.Any) -> None:
    parameters = inspect.signature(model_class(config_class.model_construct())).parameters
    assert set(config_class.size_arguments) <= set(ALL_SIZES)
    fields = set(config_class.model_fields) - BUILD_FIELDS
    assert set(parameters) == set(config_class.size_arguments) | fields
    assert not fields & set(ALL_SIZES)


def test_constructor_arguments_are_the_sizes_and_fields() -> None:
    sizes = {"num_dense": 3, "num_sparse": 4, "embedding_dim": 5}
    assert constructor_arguments(parse_model_config({"name": "lr"}), sizes) == {"num_dense": 3}
    assert constructor_arguments(parse_model_config({"name": "sasrec", "num_heads": 5}), sizes) == {
        "embedding_dim": 5,
        "max_length": 200,
        "num_blocks": 2,
        "num_heads": 5,
        "dropout": 0.2,
        "loss": "bce",
        "negatives_per": "user",
        "similarity": "dot",
        "temperature": 1.0,
    }
    assert constructor_arguments(DCNv2Config(low_rank=2, dense_init="xavier_normal"), sizes) == {
        **sizes,
        "structure": "parallel",
        "num_cross_layers": 4,
        "low_rank": 2,
        "hidden_sizes": [400, 400, 400],
        "activation": "relu",
        "batch_norm": False,
        "dropout": 0.0,
    }


def test_build_model_rejects_what_is_not_a_model_config() -> None:
    with pytest.raises(TypeError, match="not a model config"):
        build_model({"name": "lr"}, num_dense=1, num_sparse=1, embedding_dim=1)  # type: ignore[arg-type]


def test_config_values_reach_the_model() -> None:
    config = parse_model_config({"name": "dlrm", "top_hidden_sizes": [16, 8], "dropout": 0.1})
    assert isinstance(config, DLRMConfig)
    model = build_model(config, num_dense=3, num_sparse=4, embedding_dim=5)
    assert isinstance(model, DLRM)
    assert model.bottom is not None and model.bottom.output_dim == 5
    assert [m.out_features for m in model.top.modules() if isinstance(m, torch.nn.Linear)] == [16, 8, 1]
    dcn = build_model(
        DCNv2Config(structure="stacked", low_rank=2, num_cross_layers=3),
        num_dense=0,
        num_sparse=2,
        embedding_dim=4,
    )
    assert isinstance(dcn, DCNv2) and dcn.parallel is None and len(dcn.cross.weights) == 3


def test_xavier_normal_init_zeroes_biases_and_scales_weights() -> None:
    torch.manual_seed(0)
    model = build_model(
        parse_model_config({"name": "dlrm", "top_hidden_sizes": [400, 400], "dense_init": "xavier_normal"}),
        num_dense=0,
        num_sparse=10,
        embedding_dim=10,
    )
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears)
    hidden = linears[1]  # 400 -> 400: Xavier std sqrt(2 / 800) = 0.05; PyTorch's default gives 0.029
    assert hidden.weight.std().item() == pytest.approx(0.05, rel=0.02)
    default = build_model(parse_model_config({"name": "dlrm"}), num_dense=0, num_sparse=10, embedding_dim=10)
    assert [m for m in default.modules() if isinstance(m, torch.nn.Linear)][1].weight.std().item() < 0.035


def test_bars_frappe_defaults() -> None:
    deepfm = parse_model_config({"name": "deepfm"})
    assert (deepfm.hidden_sizes, deepfm.batch_norm, deepfm.dropout) == ([400, 400, 400], True, 0.2)
    dcn = parse_model_config({"name": "dcn_v2", "dropout": 0.4})
    assert (dcn.structure, dcn.num_cross_layers) == ("parallel", 4)


def test_unknown_name_lists_allowed_names() -> None:
    with pytest.raises(ValidationError, match="'dlrm'.*'sasrec'|'sasrec'.*'dlrm'"):
        parse_model_config({"name": "nope"})


def test_unknown_key_is_rejected_with_its_path() -> None:
    with pytest.raises(ValidationError, match=r"dlrm\.top_hiden_sizes"):
        parse_model_config({"name": "dlrm", "top_hiden_sizes": [4]})


@pytest.mark.parametrize(
    "data, field",
    [
        ({"name": "dlrm", "dropout": 1.5}, "dropout"),
        ({"name": "dlrm", "top_hidden_sizes": []}, "top_hidden_sizes"),
        ({"name": "deepfm", "hidden_sizes": [0]}, "hidden_sizes"),
        ({"name": "wide_deep", "activation": "swish"}, "activation"),
        ({"name": "dcn_v2", "structure": "sideways"}, "structure"),
        ({"name": "dcn_v2", "low_rank": 0}, "low_rank"),
        ({"name": "bst"}, "target_feature_index"),
        ({"name": "sasrec", "num_blocks": 0}, "num_blocks"),
    ],
)
def test_bad_values_are_rejected(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        parse_model_config(data)


def test_build_model_checks_sizes() -> None:
    with pytest.raises(ValueError, match="embedding_dim"):
        build_model(DLRMConfig(), num_dense=0, num_sparse=3, embedding_dim=0)
    with pytest.raises(ValueError, match="target_feature_index"):
        build_model(
            parse_model_config({"name": "bst", "target_feature_index": 4}),
            num_dense=0,
            num_sparse=4,
            embedding_dim=8,
        )
    with pytest.raises(ValueError, match="divisible"):
        build_model(
            parse_model_config({"name": "sasrec", "num_heads": 3}), num_dense=0, num_sparse=0, embedding_dim=8
        )


def test_model_configs_validate_without_torch() -> None:
    """`psrec train` validates the run's config and lays out its tables (which need the model's
    linear terms) without torch: the driver of a Ray run starts its cluster and actors without it.
    The schema's namespaces validate without numba: the config is loaded before Ray's start."""
    code = (
        "import sys; from psrec.config import parse_config; from psrec.models.config import uses_linear_terms; "
        "config = parse_config({'data': {'synthetic': {}}, 'model': {'name': 'deepfm'}}); "
        "assert 'torch' not in sys.modules; assert uses_linear_terms(config.model) and 'torch' not in sys.modules; "
        "assert config.feature_schema().sparse and 'numba' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
