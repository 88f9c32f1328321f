"""`ps.pipeline` in `psrec train`: the config's checks, and a 2-stage run on Ray equal to the unsplit model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.config import ConfigError, RunConfig, parse_config
from psrec.data.sequences import sasrec_schema


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """40 users' histories of 1-29 items out of 60, as `user item` lines."""
    path = tmp_path_factory.mktemp("interactions") / "interactions.txt"
    rng = np.random.default_rng(0)
    lines = [
        f"{user} {item}\n"
        for user in range(1, 41)
        for item in rng.integers(1, 61, size=rng.integers(1, 30)).tolist()
    ]
    path.write_text("".join(lines))
    return {"train": {"format": "interactions", "paths": [str(path)]}}


def sasrec_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> RunConfig:
    """A tiny SASRec (dim 8, 2 blocks, length 8, no dropout) with 2 in-process shards."""
    data = {
        "run_dir": str(run_dir),
        "data": {"schema": sasrec_schema(8).model_dump(), **sources},
        "model": {"name": "sasrec", "max_length": 8, "num_blocks": 2, "num_heads": 1, "dropout": 0.0},
        "embedding": {
            "default": {
                "dim": 8,
                "optimizer": {"name": "adam", "lr": 0.01},
                "initializer": {"kind": "normal", "std": 0.1},
            }
        },
        "training": {"batch_size": 8, "dense_optimizer": {"name": "adam", "lr": 0.01}, "seed": 3},
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 16},
        "checkpoint": {"enabled": False},
    }
    return parse_config(data, overrides=overrides)


PIPELINE = {"ps.runtime": "ray", "ps.num_trainers": 2, "ps.pipeline": {"stages": 2}}
# Dense SGD in the oracle test: the attention's key bias has an exactly zero true gradient (softmax
# ignores a constant shift), so its computed gradient is float noise that Adam would scale up to lr.
RUN = {"training.batch_size": 10, "training.dense_optimizer": {"name": "sgd", "lr": 0.1}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ps.runtime": "local"}, "ps.pipeline needs ps.runtime: ray"),
        ({"ps.mode": "async"}, "ps.pipeline needs ps.mode: sync"),
        ({"ps.strategy": "collective"}, "ps.pipeline needs ps.strategy: ps"),
        ({"ps.num_trainers": 3}, r"ps.pipeline.stages=2 must divide ps.num_trainers=3"),
        ({"ps.pipeline": {"stages": 1}}, r"ps.pipeline.stages.*greater than or equal to 2"),
        ({"ps.pipeline": {"stages": 2, "schedule": "zb"}}, r"ps.pipeline.schedule.*'gpipe' or '1f1b'"),
        ({"ps.pipeline": {"stages": 2, "microbatches": 0}}, r"ps.pipeline.microbatches"),
        ({"ps.num_trainers": 5, "ps.pipeline": {"stages": 5}}, r"stages=5 is more than the 4 parts"),
        ({"training.dense_precision": "bf16"}, "ps.pipeline supports training.dense_precision fp32 only"),
        ({"training.device": "cuda"}, "ps.pipeline trains on the CPU: set training.device to cpu"),
    ],
)
def test_pipeline_config_is_checked(
    interactions: dict[str, Any], tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        sasrec_config(interactions, tmp_path, **{**PIPELINE, **overrides})


def test_pipeline_needs_a_model_with_stages(tmp_path: Path) -> None:
    from tests.conftest import small_run_config

    with pytest.raises(ConfigError, match=r"model with stages \(sasrec, bst, hstu\), got model.name 'dlrm'"):
        small_run_config({"train": {"format": "parquet", "paths": ["x"]}}, tmp_path, **PIPELINE)


def test_pipeline_config_defaults_and_fingerprint(interactions: dict[str, Any], tmp_path: Path) -> None:
    config = sasrec_config(interactions, tmp_path, **PIPELINE)
    assert config.ps.pipeline is not None
    assert (config.ps.pipeline.microbatches, config.ps.pipeline.schedule) == (4, "1f1b")
    plain = sasrec_config(interactions, tmp_path, **{**PIPELINE, "ps.pipeline": None})
    assert config.fingerprint() != plain.fingerprint()  # the layout is part of the run


# HSTU (2 blocks, jagged) with the sampled softmax over 5 negatives per user.
HSTU = {
    "model": {
        "name": "hstu",
        "max_length": 8,
        "num_blocks": 2,
        "num_heads": 1,
        "attention_dim": 4,
        "linear_dim": 4,
        "dropout": 0.0,
        "temperature": 0.5,
    },
    "data.schema": sasrec_schema(8, num_negatives=5).model_dump(),
}


@pytest.mark.ray
@pytest.mark.parametrize("model", ["sasrec", "hstu"])
def test_two_stage_pipeline_on_ray_equals_the_unsplit_model(
    ray_cluster: None, interactions: dict[str, Any], tmp_path: Path, model: str
) -> None:
    """Trainer 0 runs the embedding and block 0, trainer 1 block 1 and the head (1F1B). The 36 training
    rows make batches of 10, 10, 10 (2 micro-batches of 5: the most up to 4 that split 10) and 6 (3
    of 2): after the epoch the dense model (on both trainers), the item table, the losses and scores
    equal one unsplit in-process trainer's. SASRec with BCE, HSTU with the sampled softmax."""
    from psrec.train.runtime import LocalRuntime, RayRuntime

    steps = 4
    model_overrides = HSTU if model == "hstu" else {}
    config = sasrec_config(
        interactions,
        tmp_path,
        **{**PIPELINE, **RUN, **model_overrides, "ps.trainer_resources": {"num_cpus": 0.5}},
    )
    runtime = RayRuntime(config, base_dir=".", data_sources=interactions)
    try:
        runtime.start_epoch(0)
        results = runtime.train_steps(steps + 1)  # one more than the data: all stop together
        dense = runtime.dense_states()
        rows = runtime.table_rows()
    finally:
        runtime.shutdown()

    oracle_config = sasrec_config(interactions, tmp_path, **RUN, **model_overrides)
    oracle = LocalRuntime(oracle_config, base_dir=".", data_sources=interactions)
    oracle.start_epoch(0)
    (want,) = oracle.train_steps(steps + 1)
    want_dense, want_rows = oracle.dense_states()[0], oracle.table_rows()
    oracle.shutdown()

    assert [r.steps for r in results] == [want.steps, want.steps] == [steps, steps]
    assert results[0].samples == want.samples == 36 and results[1].samples == 0
    assert results[0].loss_sum == pytest.approx(want.loss_sum, rel=1e-4)
    np.testing.assert_allclose(results[0].scores, want.scores, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(results[0].row_ids, want.row_ids)
    for name, value in want_dense.items():
        for trainer in (0, 1):
            torch.testing.assert_close(dense[trainer][name], value, rtol=1e-4, atol=1e-5, msg=name)
    np.testing.assert_array_equal(rows["items"][0], want_rows["items"][0])
    np.testing.assert_allclose(rows["items"][1], want_rows["items"][1], rtol=1e-4, atol=1e-5)


def run_synchronize(rank: int, world_size: int) -> dict[str, Any]:
    from psrec.models import SASRec
    from psrec.parallel.pipeline import PipelineLayout
    from psrec.trainer.pipeline_step import PipelineStepRunner

    torch.manual_seed(0)
    model = SASRec(8, max_length=8, num_blocks=2, num_heads=1, dropout=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    runner = PipelineStepRunner(
        model,
        optimizer,
        None,
        rank=rank,
        layout=PipelineLayout(world_size, 2),
        n_microbatches=2,
        schedule="1f1b",
    )  # type: ignore[arg-type]  # no client: synchronize needs none
    for parameter in runner.stepper.stage_parameters():  # a step of this rank's stage only
        parameter.grad = torch.full_like(parameter, float(rank + 1))
    optimizer.step()
    runner.synchronize()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_synchronize_gives_every_trainer_the_full_model_and_optimizer_state() -> None:
    """After a step each trainer changed only its stage; afterwards both hold both stages' parameters
    and Adam state (trainer 0's dense checkpoint is then complete)."""
    from psrec.parallel.launch import run_local_group

    first, second = run_local_group(run_synchronize, world_size=2)
    for name, value in first["model"].items():
        torch.testing.assert_close(second["model"][name], value, rtol=0, atol=0, msg=name)
    states = [first["optimizer"]["state"], second["optimizer"]["state"]]
    assert (
        set(states[0]) == set(states[1]) == set(range(len(first["optimizer"]["param_groups"][0]["params"])))
    )
    for index, state in states[0].items():
        for key, value in state.items():
            torch.testing.assert_close(states[1][index][key], value, rtol=0, atol=0)
    torch.manual_seed(0)
    from psrec.models import SASRec

    initial = SASRec(8, max_length=8, num_blocks=2, num_heads=1, dropout=0.0).state_dict()
    assert all(not torch.equal(first["model"][name], initial[name]) for name in initial)  # all stepped


@pytest.mark.ray
@pytest.mark.slow
def test_two_replicas_of_two_stages_equal_two_data_parallel_trainers(
    ray_cluster: None, tmp_path: Path
) -> None:
    """4 trainers = 2 replicas x 2 stages reach the parameters of 2 data-parallel trainers (each replica
    reads the share that trainer reads). 600 users make 3 reader units: the shares are uneven (about
    512 and 88 users), so replica 1 runs out early and contributes zero gradients and empty pushes."""
    from psrec.train.runtime import RayRuntime

    path = tmp_path / "interactions.txt"
    rng = np.random.default_rng(1)
    path.write_text(
        "".join(
            f"{user} {item}\n"
            for user in range(1, 601)
            for item in rng.integers(1, 201, size=rng.integers(3, 20)).tolist()
        )
    )
    sources = {"train": {"format": "interactions", "paths": [str(path)]}}
    run = {**RUN, "training.batch_size": 64, "ps.runtime": "ray", "ps.trainer_resources": {"num_cpus": 0.5}}
    outcomes = []
    for overrides in (
        {"ps.num_trainers": 4, "ps.pipeline": {"stages": 2, "microbatches": 2}},
        {"ps.num_trainers": 2},
    ):
        runtime = RayRuntime(
            sasrec_config(sources, tmp_path, **run, **overrides), base_dir=".", data_sources=sources
        )
        try:
            runtime.start_epoch(0)
            results = runtime.train_steps(100)
            outcomes.append((results, runtime.dense_states(), runtime.table_rows()))
        finally:
            runtime.shutdown()
    (pipeline, dense, rows), (parallel, want_dense, want_rows) = outcomes
    assert pipeline[0].steps == parallel[0].steps > pipeline[2].samples // 64 + 1  # replica 1 ran out early
    assert [r.samples for r in pipeline] == [parallel[0].samples, 0, parallel[1].samples, 0]
    assert pipeline[0].loss_sum + pipeline[2].loss_sum == pytest.approx(
        parallel[0].loss_sum + parallel[1].loss_sum, rel=1e-4
    )
    for name, value in want_dense[0].items():
        for trainer in range(4):
            torch.testing.assert_close(dense[trainer][name], value, rtol=1e-4, atol=1e-5, msg=name)
    np.testing.assert_array_equal(rows["items"][0], want_rows["items"][0])
    np.testing.assert_allclose(rows["items"][1], want_rows["items"][1], rtol=1e-4, atol=1e-5)
