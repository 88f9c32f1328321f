"""`psrec serve` on Ray Serve (embedded loopback cluster, 2 model replicas): scores through HTTP
equal the export's, bad input is a 4xx naming the field, GET /version names the version, --follow
reflects a newly committed checkpoint within 5 s, every replica's own URL (direct ingress) answers
as the proxy does, on 127.0.0.1, and a replica SIGKILLed under load fails no request with a 500:
its requests in flight are sent again to the other replica (or, at worst, answered 503), none
hangs."""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from psrec import checkpoint
from psrec.serve.export import export_run
from psrec.serve.requests import parse_request
from psrec.serve.scoring import ServingModel
from tests.serve.test_export import _raw_rows

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # Ray + Serve start-up: about a minute here


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _free_port_range(width: int = 16) -> int:
    for first in range(31000, 60000, width):
        probes = [socket.socket() for _ in range(width)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no range of free ports on 127.0.0.1")


def _post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def server(deepfm_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One app following a copy of the DeepFM run that holds only its first two checkpoints."""
    import ray

    from psrec.serve.deployment import ServeOptions, start_serving, stop_serving

    root = tmp_path_factory.mktemp("served")
    run_dir = root / "run"
    shutil.copytree(deepfm_run["run_dir"], run_dir)
    refs = checkpoint.list_checkpoints(run_dir)
    held = root / "held"
    held.mkdir()
    for ref in refs[2:]:  # committed later, by the test
        shutil.move(str(ref.path), held / ref.path.name)
    export_run(run_dir, root / "model", checkpoint=refs[0].name)
    options = ServeOptions(
        port=_free_port(),
        replicas=2,
        replica_cpus=0.5,
        follow=str(run_dir),
        poll_seconds=0.2,
        direct_ingress=True,
        direct_port=_free_port_range(),
    )
    url = start_serving(str(root / "model"), options)
    try:
        yield {
            "url": url,
            "run_dir": run_dir,
            "held": held,
            "refs": refs,
            "model": root / "model",
            "port": options.port,
        }
    finally:
        stop_serving()
        ray.shutdown()


def _wait_for_label(url: str, body: bytes, suffix: str, deadline: float) -> tuple[float, Any]:
    while time.monotonic() < deadline:
        status, answer = _post(url, body)
        assert status == 200, answer
        if answer["version"].endswith(suffix):
            return time.monotonic(), answer
        time.sleep(0.05)
    raise AssertionError(f"no response with version *{suffix} before the deadline")


def test_http_scores_follow_checkpoints_and_bad_input_is_a_4xx(
    server: dict[str, Any], deepfm_run: dict[str, Any]
) -> None:
    url, refs = server["url"], server["refs"]
    assert url.startswith("http://127.0.0.1:")
    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:64]
    body = json.dumps({"rows": rows}).encode()
    # the follower applies the second checkpoint (a delta) soon after start
    _, answer = _wait_for_label(url, body, refs[1].checkpoint_id[:8], time.monotonic() + 60)
    local = ServingModel.load(server["model"])
    from psrec.serve.follow import DeltaFollower

    DeltaFollower(local, server["run_dir"]).poll()
    expected = local.score_requests([parse_request({"rows": rows}, local.request_spec)])[0]
    assert answer["version"] == expected["version"]
    np.testing.assert_allclose(answer["scores"], expected["scores"], rtol=0, atol=1e-6)

    with urllib.request.urlopen(url + "version", timeout=30) as response:
        described = json.loads(response.read())
    assert described["version"] == answer["version"] and "C1" in described["features"]

    # a checkpoint committed now (its directory, manifest included, renamed into place)
    later = refs[2]
    committed = time.monotonic()
    (server["held"] / later.path.name).rename(later.path)
    reflected, answer = _wait_for_label(url, body, later.checkpoint_id[:8], committed + 5.0)
    print(f"commit -> first response reflecting it: {reflected - committed:.2f} s")  # shown with -s
    assert reflected - committed < 5.0

    good = dict(rows[0])
    cases: list[tuple[bytes, str, int]] = [
        (b"{not json", "body", 400),
        (b"[1, 2]", "body", 400),
        (json.dumps({"rows": [{**good, "colour": "red"}]}).encode(), "rows[0].colour", 400),
        (json.dumps({"rows": [{k: v for k, v in good.items() if k != "C3"}]}).encode(), "rows[0].C3", 400),
        (json.dumps({"rows": [{**good, "I2": "seven"}]}).encode(), "rows[0].I2", 400),
        (json.dumps({"rows": [{**good, "C5": [1, 2]}]}).encode(), "rows[0].C5", 400),
        (json.dumps({"rows": [good] * 5000}).encode(), "rows", 413),
        (json.dumps({"rows": []}).encode(), "rows", 400),
        (json.dumps({"rows": [good], "k": 3}).encode(), "k", 400),
    ]
    for payload, field, status in cases:
        code, answer = _post(url, payload)
        assert code == status, (field, answer)
        assert answer["field"] == field and field in answer["error"], answer
    code, answer = _post(url, body)  # the replica is still there
    assert code == 200 and answer["version"].endswith(later.checkpoint_id[:8])


def test_every_replica_answers_directly_on_loopback_as_the_proxy_does(
    server: dict[str, Any], deepfm_run: dict[str, Any]
) -> None:
    from psrec.serve.deployment import replica_urls

    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:16]
    body = json.dumps({"rows": rows}).encode()
    direct = replica_urls()
    assert len(direct) == 2 and all(url.startswith("http://127.0.0.1:") for url in direct), direct
    assert server["url"] not in direct
    pids = set()
    for url in direct:
        for _ in range(50):  # the two replicas may be a version apart for one poll
            status, via_proxy = _post(server["url"], body)
            code, answer = _post(url, body)
            if via_proxy["version"] == answer["version"]:
                break
            time.sleep(0.1)
        assert status == code == 200 and answer["version"] == via_proxy["version"]
        np.testing.assert_allclose(answer["scores"], via_proxy["scores"], rtol=0, atol=1e-6)
        with urllib.request.urlopen(url + "version", timeout=30) as response:
            pids.add(json.loads(response.read())["replica_pid"])
    assert len(pids) == 2  # each URL is one replica


def test_a_replica_killed_under_load_fails_no_request_with_a_500(
    server: dict[str, Any], deepfm_run: dict[str, Any]
) -> None:
    import http.client
    import os
    import signal
    import threading

    port = server["port"]
    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:32]
    body = json.dumps({"rows": rows}).encode()
    pids = set()
    for _ in range(40):
        with urllib.request.urlopen(server["url"] + "version", timeout=30) as response:
            pids.add(json.loads(response.read())["replica_pid"])
        if len(pids) == 2:
            break
    assert len(pids) == 2, pids
    answers: list[tuple[float, float, int | str, dict[str, str], bytes]] = []
    stop = threading.Event()

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(2000):  # bounded; stopped by the event well before
            if stop.is_set():
                break
            sent = time.monotonic()
            try:
                connection.request("POST", "/", body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                answers.append((sent, time.monotonic(), response.status, dict(response.headers), data))
            except (OSError, http.client.HTTPException) as error:  # a timeout would land here
                answers.append((sent, time.monotonic(), type(error).__name__, {}, b""))
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    killed = time.monotonic()
    os.kill(min(pids), signal.SIGKILL)
    time.sleep(6.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    in_flight = [a for a in answers if a[0] <= killed <= a[1]]
    assert in_flight, "no request was in flight at the kill: the test did not test the failover"
    statuses = {status for _, _, status, _, _ in answers}
    odd = [(status, headers, data) for _, _, status, headers, data in answers if status not in (200, 503)]
    assert statuses <= {200, 503}, odd  # never Serve's bare 500, never a broken connection
    for _, _, status, headers, data in answers:
        if status == 503:  # the failover's answer: a JSON message and when to come back
            assert headers.get("retry-after") == "1" and "retry" in json.loads(data)["error"]
    after = [status for sent, _, status, _, _ in answers if sent > killed + 1.0]
    assert len(after) > 20 and all(status == 200 for status in after)
    print(
        f"killed under load: {len(in_flight)} requests in flight, "
        f"{sum(status == 503 for _, _, status, _, _ in answers)} answered 503, the rest 200"
    )
