"""`psrec serve`: an export behind a JSON HTTP endpoint on Ray Serve, with request batching and replicas.

    psrec serve models/frappe --port 8000 --replicas 2          # embedded loopback cluster
    psrec serve models/frappe --follow runs/frappe_deepfm       # swap in each new checkpoint
    curl -s 127.0.0.1:8000/ -d '{"rows": [{"user": 12, "item": 7, ...}]}'

Endpoints: ``POST /`` scores rows (`psrec.serve.requests` describes the body; the response is
``{"version": ..., "scores": [...]}`` or, for SASRec and HSTU, ``{"version", "items", "scores"}`` top-k per
row); ``GET /version`` names the served version and the features a row carries.

Every replica (`ModelServer`) loads the export itself, validates each request (a bad one gets
its own 4xx and never joins a batch, so it cannot fail its neighbours), and batches concurrent
requests (``@serve.batch``, counted in rows: up to ``max_batch_rows`` rows or
``batch_wait_seconds`` of waiting, whichever comes first) into one lookup and one forward pass.
With ``follow`` each replica runs a `psrec.serve.follow.DeltaFollower`. A replica that dies: Serve's
proxy gives its requests in flight no answer, and psrec's middleware in the proxy
(`psrec.serve.proxy_retry`) sends them again to a live replica, or answers 503; Serve starts a
replacement. With ``direct_ingress`` every replica also answers HTTP on its own loopback port
(`replica_urls`), without the proxy hop (and without its retry).

HTTP listens on 127.0.0.1 unless ``host`` says otherwise; the embedded Ray cluster is loopback only
(`psrec.cluster.start.start_ray`), and on it so is each replica's inter-deployment gRPC server, which
Serve itself would open on every interface (`keep_replica_grpc_on_loopback`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from ray import serve

from psrec.cluster.start import LOOPBACK
from psrec.serve.requests import DEFAULT_MAX_ROWS, ParsedRequest, RequestError, decode_body, parse_request

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
DEFAULT_DIRECT_PORT = 30000
APPLICATION = "psrec"


@dataclass(frozen=True)
class ServeOptions:
    """How `serve_model` runs an export (plain values; the CLI maps its flags to these)."""

    port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    replicas: int = 1
    replica_cpus: float = 1.0
    threads: int = 1  # torch threads per replica
    max_batch_rows: int = 4096
    batch_wait_seconds: float = 0.001
    max_request_rows: int = DEFAULT_MAX_ROWS
    follow: str | None = None
    poll_seconds: float = 0.5
    access_log: bool = False
    shard_rows: int | None = None  # tables with more rows go to lookup shards (`psrec.serve.sharded`)
    lookup_shards: int = 2
    proxy_retry: bool = True  # psrec's middleware in Serve's proxy (`psrec.serve.proxy_retry`)
    direct_ingress: bool = False  # every replica also answers HTTP itself, on its own port
    direct_port: int = DEFAULT_DIRECT_PORT  # the first replica's port (the next ones count up)


def _rows_of(requests: list[ParsedRequest]) -> int:
    return sum(request.batch.batch_size for request in requests)


class ModelServer:
    """One model replica: the export, request batching and (optionally) its follower."""

    def __init__(self, model_dir: str, options: ServeOptions, shards: list[Any] | None = None) -> None:
        import ray
        import torch

        from psrec.serve.follow import DeltaFollower
        from psrec.serve.scoring import ServingModel
        from psrec.serve.sharded import RayShard, sharded_tables

        keep_replica_grpc_on_loopback()  # before Serve starts the server, after this constructor
        torch.set_num_threads(options.threads)
        remote = None
        if shards:
            described = ray.get([shard.describe.remote() for shard in shards], timeout=300)
            remote = sharded_tables(described, [RayShard(shard) for shard in shards])
        self.model = ServingModel.load(model_dir, max_rows=options.max_request_rows, remote_tables=remote)
        self.follower = None
        if options.follow is not None:
            self.follower = DeltaFollower(self.model, options.follow, poll_seconds=options.poll_seconds)
            self.follower.start()
        self.score.set_max_batch_size(options.max_batch_rows)  # type: ignore[attr-defined]
        self.score.set_batch_wait_timeout_s(options.batch_wait_seconds)  # type: ignore[attr-defined]

    @serve.batch(max_batch_size=4096, batch_wait_timeout_s=0.005, batch_size_fn=_rows_of)
    async def score(self, requests: list[ParsedRequest]) -> list[dict[str, Any]]:
        return self.model.score_requests(requests)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body, status = await self._answer(request)
        except Exception as error:  # a defect: answered as one, never as Serve's bare 500
            logger.exception("scoring failed")
            body, status = {"error": f"internal error while scoring: {error!r}", "field": None}, 500
        # the header tells psrec's proxy middleware that this answer is the model's own
        return JSONResponse(body, status_code=status, headers={"x-psrec-version": self.model.version.label})

    async def _answer(self, request: Any) -> tuple[dict[str, Any], int]:
        # the path below the app's route prefix (Serve passes the prefix as the ASGI root_path)
        path = request.url.path.removeprefix(request.scope.get("root_path", "")).rstrip("/")
        if request.method == "GET" and path in ("/version", ""):
            return self.describe(), 200
        if request.method != "POST" or path not in ("", "/score"):
            message = f"{request.method} {request.url.path}: POST / scores rows, GET /version describes"
            return {"error": message}, 404 if request.method in ("GET", "POST") else 405
        try:
            parsed = parse_request(decode_body(await request.body()), self.model.request_spec)
        except RequestError as error:  # answered here: a bad request never joins a batch
            return error.body(), error.status
        return await self.score(parsed), 200

    def describe(self) -> dict[str, Any]:
        version = self.model.version
        return {
            "version": version.label,
            "checkpoint": version.info,
            "kind": self.model.kind,
            "precision": self.model.precision,
            "features": self.model.request_spec.feature_names,
            "table_bytes": self.model.table_bytes(),
            "replica_pid": os.getpid(),
        }

    def __del__(self) -> None:
        if getattr(self, "follower", None) is not None:
            self.follower.stop()  # type: ignore[union-attr]


def keep_replica_grpc_on_loopback() -> None:
    """On a node whose address is 127.0.0.1 (the embedded cluster), make this replica's
    inter-deployment gRPC server listen there too.

    Serve starts that server in every replica (calls through deployment handles; the controller
    hands out its port at the replica's node address) on "[::]:0", every interface, whatever the
    node address: on the embedded cluster, where all of Ray's servers listen on 127.0.0.1 only, it
    was the one socket of a serving run that other machines could reach. Serve starts it after the
    replica's constructor (`Replica._on_initialized`), which calls this. On a node with a routable
    address (a cluster joined with --address) the server stays as Serve opens it.
    """
    import ray
    from ray.serve._private import replica

    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or ray.util.get_node_ip_address() != LOOPBACK:
        return  # another Serve layout, or a routable node address
    if getattr(add_port, "keeps_loopback", False):
        return  # done already in this process

    def add_port_on_loopback(server: Any, address: str) -> int:
        return int(add_port(server, loopback_address(address)))

    add_port_on_loopback.keeps_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_on_loopback


def loopback_address(address: str) -> str:
    """A gRPC listening address ("HOST:PORT") with the wildcard host ("[::]", "0.0.0.0", "") made
    127.0.0.1; any other address as it is."""
    host, _, port = address.rpartition(":")
    return f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0", "") else address


def application(model_dir: str, options: ServeOptions, shards: list[Any] | None = None) -> Any:
    """The Ray Serve application: ``options.replicas`` `ModelServer` replicas behind Serve's proxy
    (looking large tables up in the ``shards`` actors, when given)."""
    return serve.deployment(
        name="ModelServer",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus},
        max_ongoing_requests=max(1024, options.max_batch_rows),  # Serve compares it with the batch size
    )(ModelServer).bind(model_dir, options, shards)


def serving_environment(options: ServeOptions) -> dict[str, str]:
    """Ray Serve settings the embedded cluster starts with: psrec's proxy middleware
    (`psrec.serve.proxy_retry`), and with ``direct_ingress`` the replicas' own HTTP servers."""
    from psrec.serve.proxy_retry import CALLBACK, CALLBACK_VARIABLE

    environment = {CALLBACK_VARIABLE: CALLBACK} if options.proxy_retry else {}
    if options.direct_ingress:
        environment.update(
            {
                "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(options.direct_port),
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(options.direct_port + 1000),
                "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(options.direct_port + 1001),
                "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(options.direct_port + 2000),
            }
        )
    return environment


def start_serving(model_dir: str, options: ServeOptions, *, address: str | None = None) -> str:
    """Start Ray (embedded loopback cluster, or join ``address``), then the app; returns its URL
    (Serve's proxy; `replica_urls` lists the replicas' own with ``direct_ingress``)."""
    import ray

    from psrec.cluster.start import start_ray
    from psrec.serve.model_dir import ExportError, read_manifest
    from psrec.storage import location

    manifest = read_manifest(location(model_dir))  # a clear error here, before any replica starts
    large = _large_tables(model_dir, manifest, options)
    cpus = None if address else max(2, int(options.replicas * options.replica_cpus + 0.999))
    if address is None and not ray.is_initialized():
        # the raylet and every worker it starts (Serve's controller, proxy, replicas) inherit these
        _start_ray_with(serving_environment(options), cpus)
    else:
        start_ray(address, num_cpus=cpus)
    shards = _start_lookup_shards(model_dir, large, options) if large else None
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(
        application(model_dir, options, shards),
        name=APPLICATION,
        route_prefix="/",
        # a log line per request costs the replica and the driver more than scoring a small batch
        logging_config={"enable_access_log": options.access_log},
    )
    url = f"http://{options.host}:{options.port}/"
    if options.proxy_retry:
        _check_proxy_middleware(url)
    if options.direct_ingress:
        direct = replica_urls()
        if direct == [url]:
            raise ExportError(
                "--direct-ingress: the replicas do not answer HTTP themselves; on a cluster joined with "
                "--address, start its nodes with RAY_SERVE_ENABLE_DIRECT_INGRESS=1"
            )
        logger.info("replicas answer directly at %s", ", ".join(direct))
    logger.info("serving %s at %s with %d replica(s)", model_dir, url, options.replicas)
    return url


def _start_ray_with(environment: dict[str, str], cpus: int | None) -> None:
    """The embedded cluster, its processes started with ``environment`` (this process's is restored)."""
    from psrec.cluster.start import environment_set, start_ray

    with environment_set(environment):
        start_ray(None, num_cpus=cpus)


def _check_proxy_middleware(url: str) -> None:
    """Warn when Serve's proxy runs without `psrec.serve.proxy_retry` (a dead replica's requests then
    get Serve's 500 instead of a retry or a 503)."""
    import urllib.request

    from psrec.serve.proxy_retry import CALLBACK, CALLBACK_VARIABLE, PROXY_HEADER

    with urllib.request.urlopen(url + "version", timeout=60) as response:
        marked = response.headers.get(PROXY_HEADER.decode()) is not None
    if not marked:
        logger.warning(
            "Serve's proxy runs without psrec's retry middleware: requests of a replica that dies get "
            "Serve's 500. Start the cluster's nodes with %s=%s (an embedded cluster gets it when "
            "psrec starts Ray itself).",
            CALLBACK_VARIABLE,
            CALLBACK,
        )


def replica_urls() -> list[str]:
    """Where the app answers: with direct ingress every running replica's own URL, else the proxy's."""
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise RuntimeError("replica_urls: Ray Serve is not running (call start_serving first)")
    controller = client._controller
    groups = ray.get(controller.get_target_groups.remote(APPLICATION), timeout=60)
    return sorted(
        {
            f"http://{target.ip}:{target.port}/"
            for group in groups
            if str(getattr(group.protocol, "value", group.protocol)).upper() == "HTTP"
            for target in group.targets
        }
    )


_LOOKUP_SHARDS: list[Any] = []  # the lookup shard actors this process started


def _large_tables(model_dir: str, manifest: dict[str, Any], options: ServeOptions) -> list[str]:
    """The tables with more than ``options.shard_rows`` rows (none without it)."""
    if options.shard_rows is None:
        return []
    from psrec.serve.model_dir import SERVING_FILE, read_file_checked
    from psrec.storage import location

    serving = json.loads(read_file_checked(location(model_dir), manifest, SERVING_FILE))
    return sorted(name for name, table in serving["tables"].items() if table["rows"] > options.shard_rows)


def _start_lookup_shards(model_dir: str, tables: list[str], options: ServeOptions) -> list[Any]:
    import ray

    from psrec.serve.sharded import TableShard

    actor = ray.remote(TableShard).options(num_cpus=0)
    shards = [
        actor.remote(model_dir, shard=index, num_shards=options.lookup_shards, tables=tables)
        for index in range(options.lookup_shards)
    ]
    _LOOKUP_SHARDS.extend(shards)
    logger.info("%d lookup shards hold tables %s", len(shards), ", ".join(tables))
    return shards


def stop_serving() -> None:
    """Delete the app and shut Ray Serve down (when it runs; nothing when Ray does not), and kill
    the lookup shards this process started."""
    import ray
    from ray.serve.context import _get_global_client

    if ray.is_initialized():
        if _get_global_client(raise_if_no_controller_running=False) is not None:
            serve.delete(APPLICATION)
            serve.shutdown()
        for shard in _LOOKUP_SHARDS:
            ray.kill(shard)
    _LOOKUP_SHARDS.clear()


def serve_forever(model_dir: str, options: ServeOptions, *, address: str | None = None) -> None:
    """`psrec serve`: serve until interrupted (Ctrl-C or SIGTERM), then stop the app, Ray Serve and
    Ray, and end what is left of the embedded cluster's processes (`psrec.cluster.start.stop_ray`)."""
    from psrec.cluster.start import stop_ray

    try:
        start_serving(model_dir, options, address=address)  # interrupted too: what started is stopped
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        try:
            stop_serving()
        finally:
            stop_ray()
