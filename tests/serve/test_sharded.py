"""Sharded lookup: tables split over lookup shards by the PS routing serve exactly the scores of
the whole tables (route -> compute -> return), unknown ids included; following a run, the shards
hold each new version before the replica swaps to it, and serve the scores of its export."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec import checkpoint
from psrec.serve.export import chain_to
from psrec.serve.follow import DeltaFollower
from psrec.serve.model_dir import read_model_dir
from psrec.serve.requests import parse_request
from psrec.serve.scoring import ServingModel, tables_of
from psrec.serve.sharded import KEPT_VERSIONS, LocalShard, TableShard, partition, sharded_tables
from tests.serve.test_export import _raw_rows


def test_sharded_tables_serve_the_scores_of_whole_tables(deepfm_run: dict[str, Any], exported: Any) -> None:
    model_dir = exported(deepfm_run["run_dir"], precision="int8")
    whole = tables_of(read_model_dir(model_dir))
    large = sorted(name for name, table in whole.items() if table.num_rows >= 20)
    assert len(large) >= 5
    shards = [TableShard(model_dir, shard=s, num_shards=3, tables=large) for s in range(3)]
    for name in large:  # every row in exactly one shard
        held = np.concatenate([shard.tables[name].ids for shard in shards])
        assert np.array_equal(np.sort(held), whole[name].ids)
        assert all(shard.tables[name].num_rows > 0 for shard in shards)
    remote = sharded_tables([s.describe() for s in shards], [LocalShard(s) for s in shards])
    sharded = ServingModel.load(model_dir, remote_tables=remote)
    plain = ServingModel.load(model_dir)
    assert sharded.table_bytes() < plain.table_bytes()
    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:2000]
    request = parse_request({"rows": rows}, plain.request_spec)
    expected = plain.score_requests([request])[0]
    got = sharded.score_requests([request])[0]
    assert got["version"] == expected["version"]
    np.testing.assert_array_equal(got["scores"], expected["scores"])
    unknown = np.array([1, 2**40 + 7, 12345], dtype=np.int64)  # ids no table holds
    for name in large[:3]:
        np.testing.assert_array_equal(remote[name].lookup(unknown), whole[name].lookup(unknown))
    assert checkpoint.list_checkpoints(deepfm_run["run_dir"])  # the run is untouched


@pytest.mark.slow
@pytest.mark.ray
def test_psrec_serve_with_lookup_shard_actors(deepfm_run: dict[str, Any], exported: Any) -> None:
    """--shard-rows: the large tables live in Ray actors; HTTP scores equal the whole tables'."""
    import json
    import socket
    import urllib.request

    import ray

    from psrec.serve.deployment import ServeOptions, start_serving, stop_serving

    model_dir = exported(deepfm_run["run_dir"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    options = ServeOptions(port=port, shard_rows=20, lookup_shards=2)
    url = start_serving(str(model_dir), options)
    try:
        rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:256]
        request = urllib.request.Request(url, data=json.dumps({"rows": rows}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        with urllib.request.urlopen(url + "version", timeout=60) as response:
            described = json.loads(response.read())
    finally:
        stop_serving()
        ray.shutdown()
    plain = ServingModel.load(model_dir)
    expected = plain.score_requests([parse_request({"rows": rows}, plain.request_spec)])[0]
    np.testing.assert_array_equal(answer["scores"], expected["scores"])
    assert described["table_bytes"] < plain.table_bytes()  # the large tables are not in the replica


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_following_with_sharded_tables_serves_each_checkpoint_as_its_own_export(
    deepfm_run: dict[str, Any], exported: Any, precision: str
) -> None:
    """The follower has every lookup shard prepare each new version (a delta applied to the served
    one, or a checkpoint's whole chain) before the replica swaps: the scores then equal those of an
    export of that checkpoint, and each shard keeps its last few versions only."""
    run_dir = deepfm_run["run_dir"]
    refs = checkpoint.list_checkpoints(run_dir)
    first = exported(run_dir, precision=precision, checkpoint=refs[0].name)
    last = tables_of(read_model_dir(exported(run_dir, precision=precision)))
    large = sorted(name for name, table in last.items() if table.num_rows >= 20)  # by the run's end
    assert len(large) >= 5
    shards = [TableShard(first, shard=s, num_shards=3, tables=large) for s in range(3)]
    remote = sharded_tables([s.describe() for s in shards], [LocalShard(s) for s in shards])
    model = ServingModel.load(first, remote_tables=remote)
    follower = DeltaFollower(model, run_dir)
    rebuilds: list[bool] = []  # per version shard 0 prepared: from a whole chain (True) or a delta
    prepare = shards[0].prepare

    def counted(label: str, *, base: str | None, refs: list[Any]) -> dict[str, Any]:
        rebuilds.append(base is None)
        return prepare(label, base=base, refs=refs)

    shards[0].prepare = counted  # type: ignore[method-assign]
    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:500]
    for ref in refs[1:]:
        label = follower.poll()
        assert label is not None and label.endswith(ref.checkpoint_id[:8]), (label, ref.name)
        assert [shard.latest for shard in shards] == [label] * 3
        assert all(table.version == label for name, table in model.version.tables.items() if name in large)
        request = parse_request({"rows": rows}, model.request_spec)
        served = model.score_requests([request])[0]
        plain = ServingModel.load(exported(run_dir, precision=precision, checkpoint=ref.name))
        expected = plain.score_requests([request])[0]
        assert served["version"] == expected["version"] == label
        np.testing.assert_allclose(served["scores"], expected["scores"], rtol=0, atol=1e-6)
        assert model.table_bytes() < plain.table_bytes()
    assert follower.poll() is None
    assert [len(shard.versions) for shard in shards] == [min(len(refs), KEPT_VERSIONS)] * 3
    assert len(follower.applied) == len(refs) - 1
    assert False in rebuilds  # deltas applied on the shards
    assert (True in rebuilds) == any(ref.kind == "full" for ref in refs[1:])  # a later full: rebuilt
    with pytest.raises(LookupError, match="no longer holds version"):
        shards[0].lookup(large[0], np.array([1]), "step-0.gone")
    # a version built from the whole chain holds the shard's part of the last export
    fresh = TableShard(first, shard=1, num_shards=3, tables=large)
    fresh.prepare("rebuilt", base=None, refs=chain_to(refs[-1], refs))
    for name in large:
        expected = partition(last[name], 1, 3)
        np.testing.assert_array_equal(fresh.versions["rebuilt"][name].ids, expected.ids)
        np.testing.assert_allclose(fresh.versions["rebuilt"][name].values(), expected.values(), atol=1e-6)


def test_a_lookup_shard_refuses_a_checkpoint_of_other_tables(
    deepfm_run: dict[str, Any], exported: Any
) -> None:
    run_dir = deepfm_run["run_dir"]
    refs = checkpoint.list_checkpoints(run_dir)
    model_dir = exported(run_dir, checkpoint=refs[0].name)
    shard = TableShard(model_dir, shard=0, num_shards=2, tables=[_a_large_table(model_dir)])
    shard.names = ["no_such_table"]  # a shard of another export's tables
    with pytest.raises(ValueError, match="holds tables"):
        shard.prepare("other", base=None, refs=[refs[0]])
    assert list(shard.versions) == [shard.latest]  # nothing added


def _a_large_table(model_dir: Any) -> str:
    return max(tables_of(read_model_dir(model_dir)).items(), key=lambda item: item[1].num_rows)[0]


@pytest.mark.slow
@pytest.mark.ray
def test_psrec_serve_follows_a_run_with_lookup_shard_actors(
    deepfm_run: dict[str, Any], exported: Any, tmp_path: Path
) -> None:
    """--shard-rows with --follow: served from the run's first checkpoint, the replica and the lookup
    shard actors reach the last checkpoint present; the run's last one, committed while serving,
    is reflected within 5 s (the freshness target), with its export's scores."""
    import json
    import socket
    import time
    import urllib.request

    import ray

    from psrec.serve.deployment import ServeOptions, start_serving, stop_serving

    run_dir = tmp_path / "run"
    shutil.copytree(deepfm_run["run_dir"], run_dir)
    refs = checkpoint.list_checkpoints(run_dir)
    last = refs[-1]
    held = tmp_path / "held" / last.path.name
    held.parent.mkdir()
    shutil.move(str(last.path), held)  # committed later, while serving
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    options = ServeOptions(port=port, shard_rows=20, lookup_shards=2, follow=str(run_dir), poll_seconds=0.2)
    url = start_serving(str(exported(deepfm_run["run_dir"], checkpoint=refs[0].name)), options)
    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:256]
    body = json.dumps({"rows": rows}).encode()

    def until_version(suffix: str, deadline: float) -> tuple[float, dict[str, Any]]:
        answer: dict[str, Any] = {}
        while time.monotonic() < deadline:
            request = urllib.request.Request(url, data=body)
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = json.loads(response.read())
            if answer["version"].endswith(suffix):
                return time.monotonic(), answer
            time.sleep(0.05)
        raise AssertionError(
            f"no response with version *{suffix} before the deadline; last {answer.get('version')}"
        )

    try:
        until_version(refs[-2].checkpoint_id[:8], time.monotonic() + 120)
        committed = time.monotonic()
        held.rename(last.path)  # its directory, manifest included, renamed into place
        reflected, answer = until_version(last.checkpoint_id[:8], committed + 5.0)
        print(f"sharded follow: commit -> first response reflecting it: {reflected - committed:.2f} s")
    finally:
        stop_serving()
        ray.shutdown()
    assert reflected - committed < 5.0
    plain = ServingModel.load(exported(deepfm_run["run_dir"]))
    expected = plain.score_requests([parse_request({"rows": rows}, plain.request_spec)])[0]
    assert answer["version"] == expected["version"]
    np.testing.assert_allclose(answer["scores"], expected["scores"], rtol=0, atol=1e-6)
