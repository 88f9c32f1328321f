"""`psrec train CONFIG`: validate the config, train with a progress bar, print the summary."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="train a model as CONFIG says")
    parser.add_argument("config", help="YAML run config (see examples/)")
    parser.add_argument("--data-dir", default=".", help="base directory for relative data paths")
    parser.add_argument("--run-dir", help="override run_dir")
    parser.add_argument("--address", help="join this Ray cluster instead of starting an embedded one")
    parser.add_argument(
        "--local", action="store_true", help="run shards and trainer in this process (no Ray)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a config field (YAML value)",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest valid checkpoint (an interrupted run_dir resumes by itself)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="print where a step's time went (per phase, trainer 0's view)"
    )
    parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    parser.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    from psrec.config import ConfigError

    overrides: dict[str, Any] = {}
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected PATH=VALUE, e.g. --set training.epochs=2")
        path, value = item.split("=", 1)
        overrides[path] = yaml.safe_load(value)
    if args.run_dir:
        overrides["run_dir"] = args.run_dir
    if args.resume:
        overrides["run_dir"] = args.resume
    if args.address:
        overrides["ps.address"] = args.address
    if args.local:
        overrides["ps.runtime"] = "local"
    return overrides


def run(args: argparse.Namespace) -> int:
    from psrec.trainer.startup import paused_gc

    with paused_gc():  # the start-up's imports (see paused_gc); the config's need no torch
        from psrec.checkpoint import CheckpointError
        from psrec.config import ConfigError, load_config
        from psrec.data.errors import BadRowError

        try:
            config = load_config(args.config, overrides=_overrides(args))
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    started_ray = False
    stop = _stop_on_signals() if config.training.mode == "continuous" else None
    try:
        with paused_gc():
            if config.ps.runtime == "ray":  # Ray starts while this process imports the training code
                from psrec.cluster.start import start_ray_importing

                started_ray = start_ray_importing(config, "psrec.train.loop")
            from psrec.train.loop import train
        resume = True if args.resume else None
        if args.no_progress:
            summary = train(
                config,
                base_dir=args.data_dir,
                progress=_log_progress,
                resume=resume,
                started_at=args.started_at,
                stop=stop,
            )
        else:
            summary = _train_with_bar(config, args.data_dir, resume, started_at=args.started_at, stop=stop)
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        cause = getattr(error, "cause", error)  # unwrap an error raised inside a Ray actor
        if not isinstance(cause, BadRowError):
            raise
        print(
            f"error: bad input row: {cause}\n(fix the row, or set on_error: skip on that data source to "
            "count, log and skip malformed rows; checkpoints written so far are kept)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("interrupted: workers shut down", file=sys.stderr)
        return 130
    finally:
        if started_ray:
            from psrec.cluster.start import stop_ray

            stop_ray()
    hidden = ("history", "tables", "phase_seconds", "checkpoints")
    shown = {k: v for k, v in summary.items() if k not in hidden}
    print(json.dumps(shown, indent=2, default=float))
    if args.profile:
        print(format_profile(summary))
    print(f"summary written to {config.run_dir}/summary.json")
    return 0


def _stop_on_signals() -> threading.Event:
    """A continuous run ends cleanly on the first SIGTERM or Ctrl-C (the chunk in progress ends, a
    last checkpoint and the summary are written); a second one interrupts it at once."""
    stop = threading.Event()

    def request(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt(f"signal {signum}")
        stop.set()
        print("stopping: the last checkpoint is being written (signal again to interrupt)", file=sys.stderr)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request)
    return stop


def _lag(report: dict[str, Any]) -> str:
    return (
        f"lag {report['events_behind']} events {report['seconds_behind']:.1f} s "
        f"progressive auc {report['progressive_auc']:.4f} logloss {report['progressive_logloss']:.4f}"
    )


def _log_progress(report: dict[str, Any]) -> None:
    if "events_behind" in report:  # a continuous run: lag instead of epochs
        print(
            f"step {report['step']} samples {report['samples']} {_lag(report)} "
            f"{report['samples_per_second']:.0f} samples/s",
            flush=True,
        )
        return
    print(
        f"epoch {report['epoch']} step {report['step']} samples {report['samples']} loss {report['loss']:.4f} "
        f"auc {report['running_auc']:.4f} {report['samples_per_second']:.0f} samples/s",
        flush=True,
    )


def _train_with_bar(
    config: Any,
    data_dir: str,
    resume: bool | None,
    *,
    started_at: float | None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from psrec.train.loop import train

    total = config.training.max_steps
    continuous = config.training.mode == "continuous"
    columns = [TextColumn("[bold]train[/]"), BarColumn(), TextColumn("step {task.completed}")]
    columns += [TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    if not continuous:  # a stream has no end to estimate: its status shows the lag instead
        columns.append(TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("train", total=total, status="starting")

        def update(report: dict[str, Any]) -> None:
            if "events_behind" in report:
                status = f"{_lag(report)} {report['samples_per_second']:.0f} samples/s"
            else:
                status = (
                    f"loss {report['loss']:.4f} auc {report['running_auc']:.4f} "
                    f"{report['samples_per_second']:.0f} samples/s"
                )
            bar.update(task, total=report.get("total_steps"), completed=report["step"], status=status)

        return train(
            config, base_dir=data_dir, progress=update, resume=resume, started_at=started_at, stop=stop
        )


def format_profile(summary: dict[str, Any]) -> str:
    """A table of the per-phase time of the training steps (averaged over trainers).

    Phases run off the trainer's critical path (``*_overlapped``, e.g. the planner thread reading and
    routing the next batches) are listed below the total: they overlap the phases above.
    """
    from psrec.trainer.step import OVERLAPPED

    phases = summary.get("phase_seconds", {})
    critical = {k: v for k, v in phases.items() if not k.endswith(OVERLAPPED)}
    total = sum(critical.values()) or 1.0
    steps = max(1, int(summary.get("steps", 1)))
    lines = [f"{'phase':<18}{'seconds':>10}{'ms/step':>10}{'share':>8}"]
    for phase, seconds in sorted(critical.items(), key=lambda item: -item[1]):
        lines.append(f"{phase:<18}{seconds:>10.2f}{1000 * seconds / steps:>10.2f}{seconds / total:>8.1%}")
    lines.append(f"{'total':<18}{total:>10.2f}{1000 * total / steps:>10.2f}")
    for phase, seconds in sorted(phases.items()):
        if phase.endswith(OVERLAPPED):
            lines.append(f"{phase:<18}{seconds:>10.2f}{1000 * seconds / steps:>10.2f}  (in parallel)")
    return "\n".join(lines)
