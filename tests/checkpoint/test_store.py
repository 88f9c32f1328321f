"""Tests for the checkpoint storage layer: round trips, delta chains, shards writing their own files,
torn/corrupt/missing files, config mismatches, retention, and writers really killed with SIGKILL (before
every fsync/rename of the protocol, and at random moments). The pure decisions behind restore and
retention are tested in ``test_policy.py``.

Run: ``python -m pytest tests/checkpoint/test_store.py -q``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.checkpoint import (
    CheckpointData,
    CheckpointError,
    CheckpointRef,
    ConfigMismatchError,
    FileRecord,
    abort_checkpoint,
    apply_retention,
    begin_checkpoint,
    commit_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    resolve_restore_chain,
    save_checkpoint,
    verify,
    write_shard,
)
from psrec.checkpoint.files import fingerprint
from psrec.checkpoint.format import CHECKPOINTS_DIR
from psrec.checkpoint.policy import Kind

CONFIG: dict[str, Any] = {
    "model": {"name": "dlrm", "embedding_dim": 8, "layers": [16, 8]},
    "train": {"num_steps": 100, "learning_rate": 0.1},
    "logging": {"every": 10},
}
BUCKET_MAP = {"num_buckets": 8, "owner": [0, 1, 0, 1, 0, 1, 0, 1]}
LOGGER = "psrec.checkpoint"


def shard_arrays(step: int, shard_id: int, rows: int = 4) -> dict[str, np.ndarray]:
    """A tiny embedding-table export whose values identify (step, shard)."""
    ids = np.arange(rows, dtype=np.int64) * 2 + shard_id + 100 * step
    return {
        "user/ids": ids,
        "user/rows": np.full((rows, 3), step + shard_id / 10, dtype=np.float32),
        "user/adagrad": np.full((rows,), step, dtype=np.float32),
        "user/removed": np.array([step], dtype=np.int64),
    }


def dense_state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def make_data(step: int, num_shards: int = 2) -> CheckpointData:
    return CheckpointData(
        step=step,
        shards={s: shard_arrays(step, s) for s in range(num_shards)},
        dense=dense_state(step),
        trainers=[{"rank": r, "file": 0, "row": step * 10 + r} for r in range(2)],
        extra={"samples_seen": step * 20, "loss": 0.5},
    )


def save(run_dir: Path, step: int, kind: Kind = "full", parent: CheckpointRef | None = None) -> CheckpointRef:
    return save_checkpoint(
        run_dir, make_data(step), config=CONFIG, kind=kind, bucket_map=BUCKET_MAP, parent=parent
    )


def save_chain(run_dir: Path, steps_and_kinds: list[tuple[int, Kind]]) -> list[CheckpointRef]:
    refs: list[CheckpointRef] = []
    for step, kind in steps_and_kinds:
        refs.append(save(run_dir, step, kind, parent=refs[-1] if kind == "delta" else None))
    return refs


def assert_data_equal(loaded: CheckpointData, expected: CheckpointData) -> None:
    assert loaded.step == expected.step
    assert loaded.shards.keys() == expected.shards.keys()
    for shard_id, arrays in expected.shards.items():
        assert loaded.shards[shard_id].keys() == arrays.keys()
        for name, array in arrays.items():
            assert loaded.shards[shard_id][name].dtype == array.dtype
            np.testing.assert_array_equal(loaded.shards[shard_id][name], array)
    for key, tensor in expected.dense["model"].items():
        torch.testing.assert_close(loaded.dense["model"][key], tensor)
    assert loaded.dense["optimizer"]["param_groups"] == expected.dense["optimizer"]["param_groups"]
    torch.testing.assert_close(loaded.dense["optimizer"]["state"], expected.dense["optimizer"]["state"])
    assert loaded.dense["step"] == expected.dense["step"]
    assert loaded.trainers == expected.trainers
    assert loaded.extra == expected.extra


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def names(refs: list[CheckpointRef]) -> list[str]:
    return [ref.name for ref in refs]


# ------------------------------------------------------------------------------------- round trips


def test_full_checkpoint_round_trip(tmp_path: Path) -> None:
    ref = save(tmp_path, 7)
    assert ref.path == tmp_path / CHECKPOINTS_DIR / "ckpt-000000007-full"
    assert sorted(p.name for p in ref.path.iterdir()) == [
        "dense.pt",
        "manifest.json",
        "shard-0.npz",
        "shard-1.npz",
        "trainers.json",
    ]
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == [ref.name]  # no temp left
    assert list_checkpoints(tmp_path) == [ref]
    verify(ref)
    assert_data_equal(load_checkpoint(ref), make_data(7))

    manifest = read_manifest(ref)
    assert manifest["format_version"] == 1
    assert (manifest["step"], manifest["kind"], manifest["base"], manifest["parent"]) == (
        7,
        "full",
        None,
        None,
    )
    assert manifest["config"] == CONFIG and manifest["bucket_map"] == BUCKET_MAP
    assert manifest["config_fingerprint"] == fingerprint(CONFIG)
    assert manifest["shards"] == [0, 1]
    assert set(manifest["files"]) == {"shard-0.npz", "shard-1.npz", "dense.pt", "trainers.json"}
    assert manifest["files"]["dense.pt"]["size"] == (ref.path / "dense.pt").stat().st_size


def test_delta_chain_restores_full_then_deltas_in_order(tmp_path: Path) -> None:
    full, delta1, delta2 = save_chain(tmp_path, [(10, "full"), (20, "delta"), (30, "delta")])
    for delta, parent in [(delta1, full), (delta2, delta1)]:
        manifest = read_manifest(delta)
        assert manifest["base"]["id"] == full.checkpoint_id and manifest["base"]["name"] == full.name
        assert manifest["parent"]["id"] == parent.checkpoint_id

    chain = resolve_restore_chain(tmp_path, config=CONFIG)
    assert chain == [full, delta1, delta2]
    # What the runtime does with it: upsert every checkpoint's rows in order, dense state from the last.
    table: dict[int, float] = {}
    for ref in chain:
        rows = load_checkpoint(ref, dense=False).shards[0]
        table.update(zip(rows["user/ids"].tolist(), rows["user/rows"][:, 0].tolist(), strict=True))
    assert len(table) == 12 and table[3000] == 30.0
    assert load_checkpoint(chain[-1]).trainers[1]["row"] == 301


def test_a_new_full_checkpoint_starts_a_new_chain(tmp_path: Path) -> None:
    refs = save_chain(tmp_path, [(10, "full"), (20, "delta"), (30, "full"), (40, "delta")])
    assert resolve_restore_chain(tmp_path, config=CONFIG) == refs[2:]
    assert resolve_restore_chain(tmp_path / "elsewhere", config=CONFIG) == []


def test_load_only_some_shards(tmp_path: Path) -> None:
    ref = save(tmp_path, 3)
    flip_byte(ref.path / "shard-0.npz")  # a restarted shard 1 does not care about shard 0's file
    loaded = load_checkpoint(ref, shards=[1], dense=False)
    assert loaded.shards.keys() == {1} and loaded.dense == {}
    np.testing.assert_array_equal(loaded.shards[1]["user/ids"], shard_arrays(3, 1)["user/ids"])
    with pytest.raises(CheckpointError, match=r"has no shard\(s\) \[5\]"):
        load_checkpoint(ref, shards=[5])


def test_save_rejects_bad_arguments_without_committing(tmp_path: Path) -> None:
    full = save(tmp_path, 1)
    with pytest.raises(ValueError, match="needs a parent"):
        save(tmp_path, 2, "delta")
    with pytest.raises(ValueError, match="not older"):
        save(tmp_path, 1, "delta", parent=full)
    with pytest.raises(TypeError, match="object arrays"):
        save_checkpoint(
            tmp_path,
            CheckpointData(step=3, shards={0: {"x": np.array([{}], dtype=object)}}),
            config=CONFIG,
            kind="full",
            bucket_map=BUCKET_MAP,
        )
    with pytest.raises(TypeError, match="weights_only"):
        save_checkpoint(
            tmp_path,
            CheckpointData(step=4, shards={}, dense={"module": torch.nn.Linear(1, 1)}),
            config=CONFIG,
            kind="full",
            bucket_map=BUCKET_MAP,
        )
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, make_data(5), config={"f": object()}, kind="full", bucket_map=BUCKET_MAP)
    assert list_checkpoints(tmp_path) == [full]
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == [full.name]


def test_shards_write_their_own_files_from_other_processes(tmp_path: Path) -> None:
    pending = begin_checkpoint(tmp_path, step=5, kind="full")
    assert pickle.loads(pickle.dumps(pending)) == pending  # travels to shard actors
    records = {}
    for shard_id in (0, 1):  # each "shard process" writes its own file into the pending directory
        read_end, write_end = os.pipe()
        if (pid := os.fork()) == 0:
            record = write_shard(pending, shard_id, shard_arrays(5, shard_id))
            os.write(write_end, pickle.dumps(record))
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            records[shard_id] = pickle.loads(pipe.read())
        assert os.waitpid(pid, 0)[1] == 0
    assert list_checkpoints(tmp_path) == []  # nothing is visible before the commit

    data = make_data(5)

    def commit(shard_files: dict[int, FileRecord]) -> CheckpointRef:
        return commit_checkpoint(
            pending,
            shard_files=shard_files,
            dense=data.dense,
            trainers=data.trainers,
            extra=data.extra,
            config=CONFIG,
            bucket_map=BUCKET_MAP,
        )

    with pytest.raises(CheckpointError, match="do not match"):
        commit({0: records[0]})
    ref = commit(records)
    assert list_checkpoints(tmp_path) == [ref]
    assert_data_equal(load_checkpoint(ref), data)
    assert read_manifest(ref)["write_seconds"] > 0

    aborted = begin_checkpoint(tmp_path, step=6, kind="full")
    write_shard(aborted, 0, shard_arrays(6, 0))
    abort_checkpoint(aborted)
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == [ref.name]


def test_resaving_a_step_replaces_it_and_orphans_the_stale_deltas(tmp_path: Path) -> None:
    # A run resumed from step 10 (say 20 was corrupt) and writes step 20 again: the old 30, whose parent
    # was the old 20, must not attach to the new 20 although the name is the same.
    full, _, old30 = save_chain(tmp_path, [(10, "full"), (20, "delta"), (30, "delta")])
    new20 = save(tmp_path, 20, "delta", parent=full)
    assert names(list_checkpoints(tmp_path)) == [full.name, new20.name, old30.name]
    assert resolve_restore_chain(tmp_path, config=CONFIG) == [full, new20]


# ------------------------------------------------------------------- torn, corrupt and missing files


def test_torn_checkpoints_are_never_loaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = save(tmp_path, 10)
    root = tmp_path / CHECKPOINTS_DIR
    # Killed while writing files: the temporary directory holds a partially written shard.
    temporary = root / ".tmp-ckpt-000000020-full-123-abcd1234"
    temporary.mkdir()
    (temporary / "shard-0.npz").write_bytes((good.path / "shard-0.npz").read_bytes()[:100])
    (temporary / ".tmp-shard-1.npz-123-ffff0000").write_bytes(b"\x93NUMPY")
    # Killed after the directory rename, before the manifest: complete files but no commit marker.
    uncommitted = root / "ckpt-000000030-full"
    uncommitted.mkdir()
    for path in good.path.iterdir():
        if path.name != "manifest.json":
            (uncommitted / path.name).write_bytes(path.read_bytes())

    assert list_checkpoints(tmp_path) == [good]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_restore_chain(tmp_path, config=CONFIG) == [good]
    assert "ckpt-000000030-full: it has no manifest.json (torn write" in caplog.text

    deleted = apply_retention(tmp_path, keep_last=1)
    assert sorted(p.name for p in deleted) == sorted([temporary.name, uncommitted.name])
    assert sorted(p.name for p in root.iterdir()) == [good.name]


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    ref = save(tmp_path, 10)
    data = (ref.path / "shard-1.npz").read_bytes()
    (ref.path / "shard-1.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=r"ckpt-000000010-full: shard-1.npz has \d+ bytes, the manifest"
    ):
        verify(ref)
    with pytest.raises(CheckpointError, match="truncated"):
        verify(ref, checksums=False)


@pytest.mark.parametrize("victim", ["shard-1.npz", "dense.pt", "trainers.json"])
def test_corrupt_file_is_named_and_the_previous_checkpoint_is_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, victim: str
) -> None:
    older, newer = save(tmp_path, 10), save(tmp_path, 20)
    flip_byte(newer.path / victim)
    message = (
        rf"ckpt-000000020-full: {victim} is corrupt: sha256 [0-9a-f]{{64}}, the manifest says [0-9a-f]{{64}}"
    )
    with pytest.raises(CheckpointError, match=message):
        verify(newer)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(newer)
    verify(newer, checksums=False)  # same size: only the checksum catches it
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_restore_chain(tmp_path, config=CONFIG) == [older]
    assert f"skipping checkpoint ckpt-000000020-full: {victim} is corrupt" in caplog.text


def test_missing_shard_file_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older, newer = save(tmp_path, 10), save(tmp_path, 20)
    (newer.path / "shard-0.npz").unlink()
    with pytest.raises(CheckpointError, match="ckpt-000000020-full: shard-0.npz is missing"):
        verify(newer)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_restore_chain(tmp_path, config=CONFIG) == [older]
    assert "ckpt-000000020-full: shard-0.npz is missing" in caplog.text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text.replace('"step": 20', '"step": 21'), "manifest.json is corrupt: checksum"),
        (lambda text: text[: len(text) // 2], "manifest.json is unreadable"),
        (lambda text: text.replace('"format_version": 1', '"format_version": 99'), "format version 99"),
    ],
)
def test_corrupt_manifest_is_detected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: Any, message: str
) -> None:
    older, newer = save(tmp_path, 10), save(tmp_path, 20)
    manifest = newer.path / "manifest.json"
    manifest.write_text(edit(manifest.read_text()))
    assert list_checkpoints(tmp_path) == [older]
    with pytest.raises(CheckpointError, match=message):
        verify(newer)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_restore_chain(tmp_path, config=CONFIG) == [older]
    assert "skipping checkpoint ckpt-000000020-full: manifest.json" in caplog.text


def test_corrupt_delta_falls_back_to_the_chain_prefix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    full, delta1, delta2, delta3 = save_chain(
        tmp_path, [(10, "full"), (20, "delta"), (30, "delta"), (40, "delta")]
    )
    flip_byte(delta2.path / "shard-0.npz")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_restore_chain(tmp_path, config=CONFIG) == [full, delta1]
    assert "ckpt-000000040-delta: it needs ckpt-000000030-delta, which is invalid" in caplog.text
    assert "ckpt-000000030-delta: shard-0.npz is corrupt" in caplog.text
    flip_byte(full.path / "dense.pt")
    assert resolve_restore_chain(tmp_path, config=CONFIG) == []
    assert "no restorable checkpoint" in caplog.text


# --------------------------------------------------------------------------------- config mismatch


def test_checkpoint_from_a_different_config_is_refused(tmp_path: Path) -> None:
    save(tmp_path, 10)
    other = json.loads(json.dumps(CONFIG))
    other["model"]["embedding_dim"] = 16
    other["model"]["layers"][1] = 4
    other["model"]["dropout"] = 0.1
    other["train"]["num_steps"] = 500
    with pytest.raises(ConfigMismatchError) as caught:
        resolve_restore_chain(tmp_path, config=other)
    assert caught.value.fields == [
        "model.dropout",
        "model.embedding_dim",
        "model.layers[1]",
        "train.num_steps",
    ]
    text = str(caught.value)
    assert "ckpt-000000010-full" in text and "different config" in text
    assert "model.embedding_dim: 8 -> 16" in text and "model.dropout: <missing> -> 0.1" in text


def test_fields_that_may_change_on_resume_can_be_ignored(tmp_path: Path) -> None:
    ref = save(tmp_path, 10)
    other = json.loads(json.dumps(CONFIG))
    other["train"]["num_steps"] = 500
    other["logging"] = {"every": 1, "tensorboard": True}
    assert resolve_restore_chain(tmp_path, config=other, ignore_fields=["train.num_steps", "logging"]) == [
        ref
    ]
    other["train"]["learning_rate"] = 0.2
    with pytest.raises(ConfigMismatchError, match=r"train.learning_rate: 0.1 -> 0.2"):
        resolve_restore_chain(tmp_path, config=other, ignore_fields=["train.num_steps", "logging"])


# ----------------------------------------------------------------------------------------- retention


def test_retention_keeps_the_last_chains(tmp_path: Path) -> None:
    refs = save_chain(tmp_path, [(10, "full"), (20, "delta"), (30, "full"), (40, "delta"), (50, "full")])
    assert apply_retention(tmp_path, keep_last=2) == [refs[1].path, refs[0].path]
    assert list_checkpoints(tmp_path) == refs[2:]
    with pytest.raises(CheckpointError, match="ckpt-000000010-full: the checkpoint directory is gone"):
        verify(refs[0])
    assert resolve_restore_chain(tmp_path, config=CONFIG) == [refs[4]]
    assert apply_retention(tmp_path, keep_last=2) == []


def test_retention_never_deletes_the_only_valid_checkpoint_or_a_needed_base(tmp_path: Path) -> None:
    refs = save_chain(tmp_path, [(10, "full"), (20, "delta"), (30, "full"), (40, "full")])
    flip_byte(refs[2].path / "shard-0.npz")
    flip_byte(refs[3].path / "shard-1.npz")
    # Only 10 <- 20 is restorable: keep_last=1 must keep it (and its base), delete nothing.
    assert apply_retention(tmp_path, keep_last=1) == []
    assert resolve_restore_chain(tmp_path, config=CONFIG) == refs[:2]
    # Without checksums the corrupt ones look fine: that is what verify_checksums=True is for.
    assert apply_retention(tmp_path, keep_last=1, verify_checksums=False) == [
        refs[2].path,
        refs[1].path,
        refs[0].path,
    ]


# -------------------------------------------------------------------------------------- SIGKILL


DURABILITY_CALLS = ("fsync", "replace", "rename")  # os functions every crash-safety step goes through


def run_until_killed(
    run_dir: Path, parent: CheckpointRef, kill_before_call: int | None
) -> tuple[int, list[int]]:
    """Fork a child that saves delta 30, full 40 and applies retention, SIGKILLing itself just before its
    ``kill_before_call``-th fsync/rename/rmtree. Returns the child's wait status and the steps it committed.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_end)
            calls = 0

            def counted(original: Any) -> Any:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    nonlocal calls
                    if calls == kill_before_call:
                        os.kill(os.getpid(), signal.SIGKILL)
                    calls += 1
                    return original(*args, **kwargs)

                return wrapper

            for name in DURABILITY_CALLS:
                setattr(os, name, counted(getattr(os, name)))
            shutil.rmtree = counted(shutil.rmtree)
            save(run_dir, 30, "delta", parent=parent)
            os.write(write_end, b"30 ")
            save(run_dir, 40, "full")
            os.write(write_end, b"40 ")
            apply_retention(run_dir, keep_last=1)
            os.write(write_end, f"done:{calls} ".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        reported = pipe.read().split()
    _, status = os.waitpid(pid, 0)
    steps = [int(word) for word in reported if not word.startswith("done:")]
    total = next((int(word[5:]) for word in reported if word.startswith("done:")), -1)
    return (status if total < 0 else -total), steps


def test_killed_before_every_durability_step_leaves_a_valid_checkpoint(tmp_path: Path) -> None:
    template = tmp_path / "template"
    save_chain(template, [(10, "full"), (20, "delta")])

    def fresh_copy(name: str) -> tuple[Path, CheckpointRef]:
        run_dir = tmp_path / name
        shutil.copytree(template, run_dir)
        return run_dir, list_checkpoints(run_dir)[-1]  # same ids as in the template, paths in run_dir

    status, steps = run_until_killed(*fresh_copy("undisturbed"), kill_before_call=None)
    total_calls = -status
    assert steps == [30, 40] and total_calls > 20
    for kill_before_call in range(total_calls):
        run_dir, parent = fresh_copy(f"killed-{kill_before_call}")
        status, steps = run_until_killed(run_dir, parent, kill_before_call)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, kill_before_call
        chain = resolve_restore_chain(run_dir, config=CONFIG)
        assert chain, kill_before_call
        assert chain[-1].step >= max(steps, default=20), (kill_before_call, steps, names(chain))
        for member in chain:
            assert_data_equal(load_checkpoint(member), make_data(member.step))
        apply_retention(run_dir, keep_last=1)  # cleans up what the crash left, changes nothing restorable
        assert resolve_restore_chain(run_dir, config=CONFIG) == chain
        assert not [p for p in (run_dir / CHECKPOINTS_DIR).iterdir() if p.name.startswith(".")]


def write_forever(run_dir: Path, report: int) -> None:
    """The killed writer: resume, then write full/delta checkpoints (and prune) forever, writing each
    committed step to the ``report`` file descriptor."""
    chain = resolve_restore_chain(run_dir, config=CONFIG)
    parent = chain[-1] if chain else None
    step = parent.step if parent else 0
    big = np.zeros((256, 1024), dtype=np.float32)  # 1 MiB per shard so that kills land mid-write
    while True:
        step += 1
        kind: Kind = "delta" if parent is not None and step % 3 else "full"
        data = make_data(step)
        for arrays in data.shards.values():
            arrays["user/padding"] = big + step
        parent = save_checkpoint(
            run_dir,
            data,
            config=CONFIG,
            kind=kind,
            bucket_map=BUCKET_MAP,
            parent=parent if kind == "delta" else None,
        )
        os.write(report, f"{step}\n".encode())
        apply_retention(run_dir, keep_last=2)


def test_writer_killed_at_random_moments_always_leaves_a_valid_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1234)
    last_committed = 0
    for _ in range(6):  # each round resumes from what the previous kill left
        read_end, write_end = os.pipe()
        if (pid := os.fork()) == 0:  # a separate process, really killed
            try:
                os.close(read_end)
                write_forever(tmp_path, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        with os.fdopen(read_end) as report:
            committed = int(report.readline())  # wait for one commit, then kill at a random moment
            assert committed > last_committed
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            last_committed = max([committed, *(int(line) for line in report.read().split())])
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

        chain = resolve_restore_chain(tmp_path, config=CONFIG)
        assert chain and chain[0].kind == "full"
        assert chain[-1].step >= last_committed  # nothing the writer reported as committed was lost
        for member in chain:
            loaded = load_checkpoint(member)
            expected = make_data(member.step)
            np.testing.assert_array_equal(
                loaded.shards[1]["user/padding"], np.full((256, 1024), member.step, np.float32)
            )
            for arrays in loaded.shards.values():
                del arrays["user/padding"]
            assert_data_equal(loaded, expected)
