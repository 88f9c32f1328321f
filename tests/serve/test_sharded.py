"""Sharded lookup: tables split over lookup shards by the PS routing serve exactly the scores of
the whole tables (route -> compute -> return), unknown ids included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from psrec import checkpoint
from psrec.serve.model_dir import read_model_dir
from psrec.serve.requests import parse_request
from psrec.serve.scoring import ServingModel, tables_of
from psrec.serve.sharded import LocalShard, TableShard, sharded_tables
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


def test_follow_with_sharded_tables_is_refused_before_anything_starts(
    deepfm_run: dict[str, Any], exported: Any
) -> None:
    """--follow applies deltas inside the replicas, so it cannot follow tables held by lookup shards:
    `start_serving` says so before Ray or a replica starts."""
    import ray

    from psrec.serve.deployment import ServeOptions, start_serving
    from psrec.serve.model_dir import ExportError

    model_dir = exported(deepfm_run["run_dir"])
    options = ServeOptions(shard_rows=20, follow=str(deepfm_run["run_dir"]))
    started = ray.is_initialized()
    with pytest.raises(ExportError, match="--follow .* cannot be used with --shard-rows"):
        start_serving(str(model_dir), options)
    assert ray.is_initialized() == started
    start_serving_without_large = ServeOptions(shard_rows=10**9, follow=str(deepfm_run["run_dir"]))
    from psrec.serve.deployment import _large_tables
    from psrec.serve.model_dir import read_manifest
    from psrec.storage import location

    assert (
        _large_tables(str(model_dir), read_manifest(location(model_dir)), start_serving_without_large) == []
    )
