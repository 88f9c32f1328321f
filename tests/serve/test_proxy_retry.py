"""`psrec.serve.proxy_retry` against scripted ASGI apps standing in for Serve's proxy: a 5xx of Serve's
own (no ``x-psrec-version``) is sent again with the same body, a model's own answer is passed on as
it is, and a request no attempt answers gets a JSON 503 with ``Retry-After`` within its time bound."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import MutableMapping
from typing import Any

import pytest

from psrec.serve.proxy_retry import APP_HEADER, PROXY_HEADER, RetryDeadReplica

Message = MutableMapping[str, Any]


class ScriptedProxy:
    """Answers the n-th call with ``script[n]``: (status, from the model?) or "hang" or "raise"."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        message = await receive()
        self.bodies.append(message["body"])
        step = self.script[min(len(self.bodies), len(self.script)) - 1]
        if step == "hang":
            await asyncio.sleep(3600)
        if step == "raise":
            raise RuntimeError("the replica's actor died")
        if step == "cancelled":
            raise asyncio.CancelledError
        if step == "silent":  # how Serve's proxy ends a request whose replica died: no answer
            return
        status, from_model = step
        headers = [(b"content-type", b"application/json")] + ([(APP_HEADER, b"v1")] if from_model else [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"status": status}).encode()})


def _call(app: Any, body: bytes, *, chunks: int = 1) -> list[Message]:
    """Drive the middleware like an HTTP server: the body in ``chunks`` messages, the answer collected."""
    sent: list[Message] = []
    pieces = [body[i * len(body) // chunks : (i + 1) * len(body) // chunks] for i in range(chunks)]
    incoming = [
        {"type": "http.request", "body": piece, "more_body": index < chunks - 1}
        for index, piece in enumerate(pieces)
    ]

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/"}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
    return sent


def _status_headers_body(sent: list[Message]) -> tuple[int, dict[bytes, bytes], bytes]:
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return starts[0]["status"], dict(starts[0]["headers"]), body


def test_a_serve_500_is_sent_again_with_the_same_body() -> None:
    proxy = ScriptedProxy([(500, False), (200, True)])
    body = json.dumps({"rows": [{"user": 1}] * 50}).encode()
    status, headers, answer = _status_headers_body(_call(RetryDeadReplica(proxy), body, chunks=3))
    assert status == 200 and json.loads(answer) == {"status": 200}
    assert proxy.bodies == [body, body]  # the whole body, both times
    assert headers[PROXY_HEADER] == b"retry"


@pytest.mark.parametrize("failure", ["silent", "raise", "cancelled"])
def test_a_raising_or_silent_proxy_is_retried_too(failure: str) -> None:
    proxy = ScriptedProxy([failure, (200, True)])
    status, _, _ = _status_headers_body(_call(RetryDeadReplica(proxy), b"{}"))
    assert status == 200 and len(proxy.bodies) == 2


@pytest.mark.parametrize("status", [200, 400, 413, 500])
def test_the_models_own_answers_pass_unchanged(status: int) -> None:
    proxy = ScriptedProxy([(status, True)])
    got, headers, answer = _status_headers_body(_call(RetryDeadReplica(proxy), b"{}"))
    assert got == status and json.loads(answer) == {"status": status} and headers[APP_HEADER] == b"v1"
    assert len(proxy.bodies) == 1  # never retried: the model answered


def test_no_live_replica_is_a_json_503_with_retry_after() -> None:
    proxy = ScriptedProxy([(500, False), (502, False), (200, True)])
    status, headers, answer = _status_headers_body(_call(RetryDeadReplica(proxy, attempts=2), b"{}"))
    assert status == 503 and len(proxy.bodies) == 2
    assert headers[b"retry-after"] == b"1" and headers[b"content-type"] == b"application/json"
    message = json.loads(answer)["error"]
    assert "2 attempt(s)" in message and "502" in message


def test_a_hanging_attempt_is_a_503_within_the_time_bound() -> None:
    proxy = ScriptedProxy(["hang"])
    started = time.monotonic()
    status, _, answer = _status_headers_body(_call(RetryDeadReplica(proxy, retry_seconds=0.3), b"{}"))
    assert status == 503 and "within 0.3 s" in json.loads(answer)["error"]
    assert time.monotonic() - started < 5


def test_bad_settings_are_refused_with_their_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSREC_SERVE_RETRY_SECONDS", "0")
    with pytest.raises(ValueError, match="PSREC_SERVE_RETRY_SECONDS"):
        RetryDeadReplica(ScriptedProxy([]))
