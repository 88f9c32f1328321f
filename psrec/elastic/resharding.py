"""Changing the shard count while training: `psrec scale RUN_DIR --shards N` and the driver's side.

`psrec scale` (`request_scale`) checks that a driver is training in RUN_DIR and writes a request,
atomically, to ``RUN_DIR/scale-request.json``. The driver (`ScaleController.poll`, called between
the trainers' chunks of steps) picks it up, checks it, and then, one round per step boundary:

1. starts the new shard actors (growing), without waiting for them: training goes on meanwhile;
2. once they answer, moves at most ``buckets_per_round`` virtual buckets per boundary to where the
   balanced layout of N shards puts them (`psrec.ps.bucket_move`: copy rows, optimizer state,
   counts and snapshots; every trainer switches to the new, versioned bucket map; the source drops
   its copy). No pull or push is in flight at a boundary, so nothing is lost or applied twice;
3. stops the shards left without buckets (shrinking).

``RUN_DIR/scale.json`` says where it stands (``state``: accepted, starting, moving, done or refused,
with the rounds done, the pause of each and a message) and keeps every request handled; the run's
``summary.json`` lists them under ``resharding``. ``RUN_DIR/driver.json`` names the training process
while it runs (`psrec scale` refuses a run without one). The next checkpoint after a move is full;
checkpoints restore into any shard count (`psrec.ps.reshard`).

A shard that dies during a resharding: with ``fault_tolerance.shard_failover`` it is rebuilt alone
from its log, which holds the rows it imported and the buckets it dropped like any other change
(`psrec.ps.replay`), and the driver's move calls are sent again once it is back (an import is named,
so a repeat adds nothing); without it, or when the failover fails, the job rolls back as on any actor
failure, into the layout of that moment, and the moves go on from there.

Refused, with the reason in ``scale.json`` and nothing moved: a count below 1 or above
``ps.num_buckets``, a second request while one is in progress, an unreadable request, strategy
``collective`` (the trainers hold the tables), a count the Ray cluster has no CPUs for.

A request may carry ``"trainers": N`` (``psrec scale RUN_DIR --trainers N``), alone or with
``"shards"``: the trainer count changes first (`psrec.elastic.trainer_scaling`, state ``starting``
while added trainers start), then the shards move.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, cast

import numpy as np

from psrec import storage
from psrec.config import RunConfig
from psrec.elastic import autoscale, trainer_scaling
from psrec.elastic.runtime_api import ElasticRuntime, RayActorsRuntime
from psrec.ps import bucket_move
from psrec.ps.bucket_move import MoveError

logger = logging.getLogger(__name__)

REQUEST_FILE = "scale-request.json"
STATUS_FILE = "scale.json"
DRIVER_FILE = "driver.json"
DEFAULT_BUCKETS_PER_ROUND = 64
START_TIMEOUT_S = 300.0  # new shard actors that do not answer by then: the request is refused


class ScaleError(ValueError):
    """A scale request that cannot be made (`psrec scale` prints it)."""


class Phase(enum.Enum):
    """The controller's life cycle: idle -> (starting ->) moving -> idle."""

    IDLE = "idle"
    STARTING = "starting"
    MOVING = "moving"
    TRAINERS = "trainers"  # a trainer count changes first (`psrec.elastic.trainer_scaling`)


# -- the CLI side ------------------------------------------------------------------------------------
def request_scale(
    run_dir: str,
    shards: int | None = None,
    *,
    trainers: int | None = None,
    buckets_per_round: int = DEFAULT_BUCKETS_PER_ROUND,
) -> dict[str, Any]:
    """Ask the driver training in `run_dir` to change its shard count to `shards` and / or its
    trainer count to `trainers`; the request written.

    Raises `ScaleError` (naming the value and what to do) when no driver trains there, when its
    config cannot reshard (or change trainers), when `shards` is outside [1, ps.num_buckets] or
    `trainers` below 1, or when a request is already waiting or in progress."""
    if shards is None and trainers is None:
        raise ScaleError("give the new count: --shards N, --trainers N or both")
    wanted = _describe({"shards": shards, "trainers": trainers})
    setting = " ".join(
        f"--set ps.num_{key}={value}" for key, value in (("shards", shards), ("trainers", trainers)) if value
    )
    root = storage.location(run_dir)
    config = _read_json(root / "config.json", what="the run's config")
    if config is None:
        raise ScaleError(f"{run_dir}: not a psrec run directory (no config.json)")
    driver = _read_json(root / DRIVER_FILE, what="the driver's file")
    if driver is None:
        raise ScaleError(
            f"{run_dir}: no training is running there (no {DRIVER_FILE}; a finished or stopped run has "
            f"none). To train with {wanted}, resume it: psrec train CONFIG --resume {run_dir} {setting}"
        )
    if driver.get("host") == socket.gethostname() and not _alive(int(driver.get("pid", -1))):
        raise ScaleError(
            f"{run_dir}: the driver that trained it (pid {driver.get('pid')}) is not running any more; "
            f"resume the run with {setting}"
        )
    refusal = config_refusal(_Settings.of_json(config)) if shards is not None else None
    if refusal is None and trainers is not None:
        refusal = trainer_scaling.refusal_of_json(config)
    if refusal:
        raise ScaleError(f"{run_dir}: {refusal}")
    if shards is not None:
        try:
            bucket_move.check_shard_count(shards, int(config["ps"]["num_buckets"]))
        except MoveError as error:
            raise ScaleError(f"--shards {shards}: {error}") from None
    if trainers is not None:
        problem = trainer_scaling.count_error(trainers, current=0, free_cpus=None, cpus_per_trainer=0)
        if problem:
            raise ScaleError(f"--trainers {trainers}: {problem}")
    if isinstance(buckets_per_round, bool) or not isinstance(buckets_per_round, int) or buckets_per_round < 1:
        raise ScaleError(f"--buckets-per-round must be an integer >= 1, got {buckets_per_round!r}")
    waiting = _read_json(root / REQUEST_FILE, what="the waiting request")
    if waiting is not None:
        raise ScaleError(
            f"{run_dir}: request {waiting.get('id')} (to {_describe(waiting)}) waits for the "
            "driver already; wait until scale.json says done or refused, then ask again"
        )
    status = _read_json(root / STATUS_FILE, what="the scale status")
    current = (status or {}).get("current") or {}
    if current.get("state") in ("accepted", "starting", "moving"):
        raise ScaleError(
            f"{run_dir}: {_change(current)} is in progress ({current.get('state')}"
            + (f", {current['buckets_left']} buckets left" if current.get("buckets_left") is not None else "")
            + "): wait until scale.json says done, then ask again"
        )
    request: dict[str, Any] = {
        "id": uuid.uuid4().hex[:12],
        **({"shards": shards} if shards is not None else {}),
        **({"trainers": trainers} if trainers is not None else {}),
        "buckets_per_round": buckets_per_round,
        "requested_at": time.time(),
    }
    _write_json(root / REQUEST_FILE, request)
    return request


def wait_for(run_dir: str, request_id: str, *, timeout: float) -> dict[str, Any]:
    """The scale status entry of `request_id` once it is done or refused (polled every 0.2 s)."""
    root = storage.location(run_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _read_json(root / STATUS_FILE, what="the scale status") or {}
        for entry in [status.get("current") or {}, *status.get("history", [])]:
            if entry.get("id") == request_id and entry.get("state") in (
                "done",
                "refused",
                "stopped",
                "failed",
            ):
                return entry
        time.sleep(0.2)
    raise ScaleError(
        f"{run_dir}: request {request_id} not finished after {timeout:.0f} s (see {STATUS_FILE})"
    )


def _describe(request: dict[str, Any]) -> str:
    """ "3 shards", "2 trainers" or "3 shards, 2 trainers": what a request asks for."""
    parts = [f"{request[key]} {key}" for key in ("shards", "trainers") if request.get(key) is not None]
    return ", ".join(parts) or "nothing"


def _change(request: dict[str, Any]) -> str:
    """ "resharding to 3 shards", "changing to 2 trainers" or "scaling to 3 shards, 2 trainers"."""
    if request.get("trainers") is None:
        return f"resharding to {_describe(request)}"
    return f"{'changing' if request.get('shards') is None else 'scaling'} to {_describe(request)}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: storage.Location, *, what: str) -> dict[str, Any] | None:
    """The JSON object at `path`, None when there is no file; a `ScaleError` naming it when it is not
    one."""
    try:
        if not path.exists():
            return None
        value = json.loads(path.read_text())
    except (OSError, storage.StorageError, ValueError) as error:
        raise ScaleError(f"{path}: {what} cannot be read ({error})") from None
    if not isinstance(value, dict):
        raise ScaleError(f"{path}: {what} is not a JSON object")
    return value


def _write_json(path: storage.Location, value: dict[str, Any]) -> None:
    """Written whole or not at all: a temporary name then a rename (an object store's put is atomic)."""
    text = json.dumps(value, indent=2, default=float)
    if isinstance(path, storage.StoragePath):
        path.write_text(text)
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


# -- what can reshard ----------------------------------------------------------------------------------
class _Settings:
    """The config fields a resharding depends on, from a RunConfig or the run's config.json."""

    def __init__(self, strategy: str, num_buckets: int) -> None:
        self.strategy = strategy
        self.num_buckets = num_buckets

    @classmethod
    def of(cls, config: RunConfig) -> _Settings:
        return cls(config.ps.strategy, config.ps.num_buckets)

    @classmethod
    def of_json(cls, config: dict[str, Any]) -> _Settings:
        ps = config.get("ps", {})
        return cls(ps.get("strategy", "ps"), int(ps.get("num_buckets", 1024)))


def config_refusal(settings: _Settings) -> str | None:
    """Why a run with these settings cannot change its shard count while training, or None."""
    if settings.strategy == "collective":
        return (
            "strategy 'collective' keeps the tables in the trainers, not in shards: there are no shards "
            "to add or remove"
        )
    return None


# -- the driver's side ---------------------------------------------------------------------------------
class ScaleController:
    """Polls the run directory for scale requests and carries them out, one round per step boundary
    (see the module docstring). `poll` returns True when buckets moved (the next checkpoint must then
    be full)."""

    def __init__(self, run_dir: str, config: RunConfig, runtime: ElasticRuntime) -> None:
        self.root = storage.location(run_dir)
        self.settings = _Settings.of(config)
        self.autoscale = config.ps.autoscale
        self._at_limit_said = False
        self.trainer_refusal = trainer_scaling.refusal_of(config)
        self.shards = runtime.shard_set()
        self.runtime = runtime
        self.phase = Phase.IDLE
        self.current: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self._target: np.ndarray | None = None
        self._started_at = 0.0
        self._trainers: trainer_scaling.TrainerChange | None = None

    # -- the driver's file ---------------------------------------------------------------------------
    def begin(self) -> None:
        """Say that this process trains the run (`psrec scale` looks for it)."""
        _write_json(
            self.root / DRIVER_FILE,
            {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()},
        )

    def end(self) -> None:
        """The run is over: a resharding still going on stops here (the model is whole at every
        boundary), and the driver's file goes."""
        if self.current is not None and self.phase is not Phase.IDLE:
            self._finish("stopped", f"the run ended before {_change(self.current)} was done")
        if self.shards is not None:
            self.shards.abandon()
        if self._trainers is not None:
            self._trainers.abandon()
        try:
            (self.root / DRIVER_FILE).unlink(missing_ok=True)
        except (OSError, storage.StorageError) as error:
            logger.warning("%s stays: %s", self.root / DRIVER_FILE, error)

    def report(self) -> list[dict[str, Any]]:
        """Every request handled so far, oldest first (summary.json's ``resharding``)."""
        return [*self.history, *([self.current] if self.current is not None else [])]

    # -- between steps ---------------------------------------------------------------------------------
    def poll(self, step: int) -> bool:
        if self.phase is Phase.IDLE:
            self._take_request(step)
        if self.phase is Phase.TRAINERS:
            self._refuse_waiting()
            if not self._trainers_round(step):
                return False
        if self.phase is Phase.STARTING:
            assert self.shards is not None
            try:
                ready = self.shards.ready()
            except Exception as error:  # noqa: BLE001 - a new shard that died while starting
                self.shards.abandon()
                self._finish("refused", f"a new shard failed to start: {error}")
                return False
            if not ready:
                if time.monotonic() - self._started_at > START_TIMEOUT_S:
                    self.shards.abandon()
                    self._finish("refused", f"the new shards did not start within {START_TIMEOUT_S:.0f} s")
                return False
            self.shards.adopt(step)
            assert self.current is not None
            self.current["start_seconds"] = time.monotonic() - self._started_at  # request -> shards answer
            self.phase = Phase.MOVING
        elif self.phase is Phase.MOVING:
            self._refuse_waiting()
        if self.phase is Phase.MOVING:
            return self._round(step)
        return False

    def _take_request(self, step: int) -> None:
        path = self.root / REQUEST_FILE
        try:
            if not path.exists():
                self._autoscale(step)
                return
            text = path.read_text()
            path.unlink(missing_ok=True)
        except (OSError, storage.StorageError) as error:
            logger.warning("%s cannot be read: %s", path, error)
            return
        self._begin(step, *self._checked(text))

    def _autoscale(self, step: int) -> None:
        """``ps.autoscale``: grow when a shard's rows pass the limit (`psrec.elastic.autoscale`)."""
        settings = self.autoscale
        if settings is None or self.shards is None or config_refusal(self.settings) is not None:
            return
        decision = autoscale.decide(
            self.shards.row_bytes(),
            limit_bytes=settings.max_shard_memory_gb * autoscale.GIB,
            max_shards=settings.max_shards,
            fill=settings.fill,
        )
        if isinstance(decision, autoscale.AtLimit):
            if not self._at_limit_said:
                logger.warning("step %d: %s", step, decision.reason)
                self._at_limit_said = True
            return
        if decision is None:
            return
        request = {
            "id": f"auto-{uuid.uuid4().hex[:8]}",
            "shards": decision.shards,
            "buckets_per_round": DEFAULT_BUCKETS_PER_ROUND,
            "requested_at": time.time(),
            "requested_by": "ps.autoscale",
            "reason": decision.reason,
        }
        logger.info("step %d: %s: resharding to %d shards", step, decision.reason, decision.shards)
        problem = self.shards.capacity_error(decision.shards)
        self._begin(step, request, problem)
        if problem is not None:  # refused (scale.json says why): not asked again at every boundary
            self.autoscale = None

    def _begin(self, step: int, request: dict[str, Any], problem: str | None) -> None:
        self.current = {**request, "state": "accepted", "step": step, "rounds": []}
        if problem is not None:
            self._finish("refused", problem)
            return
        if request.get("trainers") is not None:
            self._begin_trainers(step)
        else:
            self._begin_shards(step)

    def _begin_trainers(self, step: int) -> None:
        assert self.current is not None
        count, wanted = self.runtime.num_trainers, int(self.current["trainers"])
        self.current.update(from_trainers=count, accepted_at=time.time(), state="starting")
        logger.info("step %d: %d -> %d trainers (request %s)", step, count, wanted, self.current["id"])
        # only a Ray runtime gets here: `trainer_refusal` refuses trainer changes elsewhere
        self._trainers = trainer_scaling.TrainerChange(cast(RayActorsRuntime, self.runtime), wanted)
        self._trainers.start()
        self.phase = Phase.TRAINERS
        self._write_status()

    def _trainers_round(self, step: int) -> bool:
        """The trainer change at this boundary (`TrainerChange.advance`); True when the request goes
        on with its shards in the same call."""
        change, current = self._trainers, self.current
        assert change is not None and current is not None
        try:
            outcome, detail = change.advance(step)
        except BaseException:
            self._trainers = None
            self._finish(
                "failed", "the trainers failed while switching: the run rolls back to its last checkpoint"
            )
            raise
        if outcome == "waiting":
            return False
        self._trainers = None
        if isinstance(detail, str):
            self._finish("refused", detail)
            return False
        current.update(detail or {})
        if current.get("shards") is None:
            self._finish("done", None)
            return False
        self.phase = Phase.IDLE
        self._begin_shards(step)
        return True

    def _begin_shards(self, step: int) -> None:
        assert self.current is not None
        request = self.current
        assert self.shards is not None
        count, wanted = self.shards.count(), int(request["shards"])
        self.current.update(from_shards=count, shards=wanted)
        self.current.setdefault("accepted_at", time.time())
        self._target = bucket_move.balanced_map(self.runtime.bucket_map(), wanted)
        self.current["buckets_left"] = int(np.count_nonzero(self._target != self.runtime.bucket_map()))
        logger.info("step %d: resharding %d -> %d shards (request %s)", step, count, wanted, request["id"])
        if wanted > count:
            self.shards.start(wanted)
            self._started_at = time.monotonic()
            self.phase = Phase.STARTING
            self.current["state"] = "starting"
        else:
            self.phase = Phase.MOVING
            self.current["state"] = "moving"
        self._write_status()

    def _checked(self, text: str) -> tuple[dict[str, Any], str | None]:
        """The request and why it is refused (None: it is carried out)."""
        where = str(self.root / REQUEST_FILE)
        try:
            request = json.loads(text)
        except ValueError as error:
            return {"id": None}, f"{where} is not JSON ({error}): write it with psrec scale"
        if not isinstance(request, dict):
            return {"id": None}, f"{where} is not a JSON object: write it with psrec scale"
        if request.get("shards") is None and request.get("trainers") is None:
            return request, f"{where}: give shards, trainers or both: write it with psrec scale"
        refusal = config_refusal(self.settings) if request.get("shards") is not None else None
        if refusal is None and request.get("trainers") is not None:
            shards = self.shards.count() if self.shards is not None else 0
            refusal = self.trainer_refusal or trainer_scaling.capacity_error(
                cast(RayActorsRuntime, self.runtime), request, shards
            )
        if refusal is None and self.shards is None and request.get("shards") is not None:
            refusal = "this runtime cannot change its shard count while training"
        if refusal is not None or request.get("shards") is None:
            return request, refusal
        try:
            wanted = bucket_move.check_shard_count(request.get("shards"), self.settings.num_buckets)
        except MoveError as error:
            return request, f"{where}: shards: {error}"
        per_round = request.setdefault("buckets_per_round", DEFAULT_BUCKETS_PER_ROUND)
        if isinstance(per_round, bool) or not isinstance(per_round, int) or per_round < 1:
            return request, f"{where}: buckets_per_round must be an integer >= 1, got {per_round!r}"
        assert self.shards is not None
        return request, self.shards.capacity_error(wanted)

    def _refuse_waiting(self) -> None:
        """A request that arrives while another is carried out is refused (nothing of it is done)."""
        path = self.root / REQUEST_FILE
        if not path.exists():
            return
        try:
            request = json.loads(path.read_text())
        except ValueError:
            request = {}
        path.unlink(missing_ok=True)
        assert self.current is not None
        self.history.append(
            {
                **(request if isinstance(request, dict) else {}),
                "state": "refused",
                "message": f"{_change(self.current)} is in progress: ask again once it is done",
            }
        )
        self._write_status()

    def _round(self, step: int) -> bool:
        """One round of moves at this boundary; the last one retires emptied shards. True if buckets moved."""
        assert self.shards is not None and self._target is not None and self.current is not None
        current_map = self.runtime.bucket_map()
        rounds = bucket_move.move_rounds(
            current_map, self._target, max_buckets=int(self.current["buckets_per_round"])
        )
        moved = False
        if rounds:
            moves = rounds[0]
            started = time.perf_counter()
            rows = self.shards.move(moves, self.settings.num_buckets)
            copied = time.perf_counter()
            new_map = bucket_move.apply_round(current_map, moves)
            self.shards.switch(new_map, self.runtime.routing_version + 1)
            switched = time.perf_counter()
            self.shards.drop(moves, self.settings.num_buckets)
            done = time.perf_counter()
            buckets = sum(len(m.buckets) for m in moves)
            self.current["rounds"].append(
                {
                    "step": step,
                    "buckets": buckets,
                    "rows": rows,
                    "seconds": done - started,
                    "copy_seconds": copied - started,
                    "switch_seconds": switched - copied,
                    "drop_seconds": done - switched,
                }
            )
            self.current["buckets_left"] = int(np.count_nonzero(self._target != new_map))
            moved = True
        if len(rounds) <= 1:
            self.shards.retire(int(self.current["shards"]))
            self._finish("done", None)
        else:
            self._write_status()
        return moved

    def _finish(self, state: str, message: str | None) -> None:
        assert self.current is not None
        self.current.update(state=state, finished_at=time.time())
        if message is not None:
            self.current["message"] = message
            logger.warning("scale request %s %s: %s", self.current.get("id"), state, message)
        elif self.current.get("shards") is None:
            logger.info("training on %d trainers", self.current["trainers"])
        else:
            rounds = self.current["rounds"]
            logger.info(
                "resharded to %d shards: %d buckets in %d rounds, %.3f s of pauses",
                self.current["shards"],
                sum(r["buckets"] for r in rounds),
                len(rounds),
                sum(r["seconds"] for r in rounds),
            )
        self.history.append(self.current)
        self.current, self._target, self.phase = None, None, Phase.IDLE
        self._write_status()

    def _write_status(self) -> None:
        status = {"current": self.current, "history": self.history}
        try:
            _write_json(self.root / STATUS_FILE, status)
        except (OSError, storage.StorageError) as error:
            logger.warning("%s not written: %s", self.root / STATUS_FILE, error)
