"""A request whose replica died is sent again, or answered 503: an ASGI middleware in Ray Serve's proxy.

When a replica dies (killed, out of memory, its node lost), Ray Serve's HTTP proxy answers the
requests that replica had in flight with a bare 500. Scoring is a pure read, so such a request can
simply be sent again: this middleware, which Serve's proxy loads at start through
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=psrec.serve.proxy_retry:proxy_middlewares`` (set by
`psrec.serve.deployment.start_serving` for the embedded cluster), keeps each request's body (the
proxy holds it anyway) and, when the answer is a 5xx that did not come from psrec's replica (every
`ModelServer` answer carries the ``x-psrec-version`` header), or no answer at all (what Serve's
proxy gives a request whose replica died: the HTTP server then sends a bare 500), sends it again, at most ``attempts``
times in all and within ``retry_seconds``. Serve's router has by then dropped the dead replica, so
the second attempt goes to a live one. A request that still has no answer gets a 503 with a JSON
message and ``Retry-After``, never a bare 500 and never a hang.

The middleware sits in the proxy's process, in front of Serve's routing: it adds no hop, no actor
call and no copy beyond the body it keeps. Every answer it passes on is marked ``x-psrec-proxy``,
which is how `start_serving` checks that the proxy loaded it (a cluster joined with ``--address``
loads it only when its nodes were started with the variable).

Settings (environment of the proxy): ``PSREC_SERVE_RETRY_ATTEMPTS`` (2) and
``PSREC_SERVE_RETRY_SECONDS`` (10: the most a request waits for a live replica in all).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "psrec.serve.proxy_retry:proxy_middlewares"
APP_HEADER = b"x-psrec-version"  # on every answer of a psrec replica
PROXY_HEADER = b"x-psrec-proxy"  # on every answer this middleware passes on
DEFAULT_ATTEMPTS = 2
DEFAULT_RETRY_SECONDS = 10.0
RETRY_AFTER_SECONDS = 1


class _Attempt:
    """One try of a request: forwards the answer unless it is a 5xx from Serve itself."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.failed_status: int | None = None
        self.started = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            from_app = any(key.lower() == APP_HEADER for key, _ in headers)
            if message["status"] >= 500 and not from_app:
                self.failed_status = int(message["status"])
                return
            message = {**message, "headers": [*headers, (PROXY_HEADER, b"retry")]}
            self.started = True
        elif self.failed_status is not None:
            return  # the body of a failed try is dropped with its start
        await self._send(message)


class RetryDeadReplica:
    """The ASGI middleware (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, *, attempts: int | None = None, retry_seconds: float | None = None
    ) -> None:
        self.app = app
        self.attempts = attempts or int(os.environ.get("PSREC_SERVE_RETRY_ATTEMPTS", DEFAULT_ATTEMPTS))
        self.retry_seconds = (
            retry_seconds
            if retry_seconds is not None
            else float(os.environ.get("PSREC_SERVE_RETRY_SECONDS", DEFAULT_RETRY_SECONDS))
        )
        if self.attempts < 1 or self.retry_seconds <= 0:
            raise ValueError(
                f"PSREC_SERVE_RETRY_ATTEMPTS must be >= 1 and PSREC_SERVE_RETRY_SECONDS > 0, "
                f"got {self.attempts} and {self.retry_seconds}"
            )

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        deadline = time.monotonic() + self.retry_seconds
        status: int | str = "no answer"
        for attempt in range(self.attempts):
            try_ = _Attempt(send)
            sent = False

            async def replay() -> Message:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await receive()  # after the body: the client's disconnect, if it comes

            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.app(scope, replay, try_.send), timeout=left)
            except TimeoutError:
                if try_.started:
                    raise
                status = f"no answer within {self.retry_seconds:g} s"
                break
            except (Exception, asyncio.CancelledError) as error:  # Serve raised instead of answering
                task = asyncio.current_task()
                if try_.started or (task is not None and task.cancelling()):
                    raise  # an answer under way, or this request itself cancelled (client gone)
                try_.failed_status = 500
                logger.warning("attempt %d: the proxy raised %r", attempt + 1, error)
            if try_.started:
                return
            # a 5xx of Serve's own, or no answer at all (Serve's proxy sends nothing for a dead
            # replica's request and leaves the 500 to the HTTP server)
            status = try_.failed_status or "no answer"
            logger.warning(
                "%s %s: attempt %d of %d answered %s by the proxy (its replica died?)",
                scope.get("method"),
                scope.get("path"),
                attempt + 1,
                self.attempts,
                status,
            )
        await _unavailable(send, status, self.attempts)


async def _unavailable(send: Send, status: int | str, attempts: int) -> None:
    message = (
        f"no model replica could answer ({attempts} attempt(s), the last: {status}); "
        f"a replica is being replaced: retry after {RETRY_AFTER_SECONDS} s"
    )
    payload = json.dumps({"error": message, "field": None}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
                (PROXY_HEADER, b"retry"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def proxy_middlewares() -> list[Any]:
    """What Ray Serve's proxy calls (by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``) at its start."""
    from starlette.middleware import Middleware

    return [Middleware(RetryDeadReplica)]
