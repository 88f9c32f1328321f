"""A first-order throughput model for psrec with N trainers x M shards (see docs/scaling.md).

Inputs are what `psrec bench` measures (`StepCosts.from_runs`): the in-process run's per-phase
times and CPU cost per sample, the bytes pulled/pushed per sample, and a Ray run's extra time and CPU
per step. A sync step of one trainer (batch b) then costs

    T = t_trainer                                   # plan + forward + backward + optimizer + other
      + 2 * t_rpc                                   # pull and push round trips (Ray), fixed per step
      + max(1, N / M) * b * (p + q) / W             # rows + gradients on the busiest NIC (trainer or shard)
      + N * b * c_shard / M                          # the shard's lookup + optimizer work, N trainers' worth
      + 2 (N - 1) / N * 4 P / W                      # ring allreduce of P dense fp32 parameters
    X_dedicated = N * b / T                          # samples/s, every process on its own cores

with W the per-process network bandwidth (bytes/s). On one machine whose C cores all processes share,
the job is also bounded by its CPU work: X <= C * samples_per_cpu_second, where a Ray layout's CPU per
sample is the in-process one plus the Ray overhead measured on the 1x2 layout; the prediction is
the smaller of the two bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INFINITE_BANDWIDTH = float("inf")


@dataclass(frozen=True)
class StepCosts:
    batch_size: int
    trainer_seconds: float  # per step, trainer-side work (in-process run, minus shard work)
    shard_seconds_per_sample: float  # shard CPU (lookup + insert + optimizer) per sample
    rpc_seconds: float  # extra per remote call (pull or push) on Ray, per step
    bytes_pulled_per_sample: float
    bytes_pushed_per_sample: float
    dense_parameters: int
    cpu_seconds_per_sample: float  # in-process, all threads
    ray_cpu_seconds_per_sample: float  # extra CPU per sample on Ray (serialisation, actors)

    @staticmethod
    def from_runs(
        local: dict[str, Any], ray: dict[str, Any], *, batch_size: int, dense_parameters: int
    ) -> StepCosts:
        """From bench rows of the in-process system and the Ray 1x2 system (same workload)."""
        local_ms, ray_ms = local["profile"], ray["profile"]
        shard_ms = local_ms.get("pull", 0.0) + local_ms.get("push", 0.0)
        rpc_ms = max(0.0, (ray_ms.get("pull", 0.0) + ray_ms.get("push", 0.0) - shard_ms) / 2)
        local_cpu = 1.0 / local["samples_per_cpu_second"]
        ray_cpu = 1.0 / ray["samples_per_cpu_second"]
        return StepCosts(
            batch_size=batch_size,
            trainer_seconds=(local_ms["total"] - shard_ms) / 1000,
            shard_seconds_per_sample=shard_ms / 1000 / batch_size,
            rpc_seconds=rpc_ms / 1000,
            bytes_pulled_per_sample=local["bytes_pulled_per_sample"],
            bytes_pushed_per_sample=local["bytes_pushed_per_sample"],
            dense_parameters=dense_parameters,
            cpu_seconds_per_sample=local_cpu,
            ray_cpu_seconds_per_sample=max(0.0, ray_cpu - local_cpu),
        )


def step_seconds(
    costs: StepCosts, *, trainers: int, shards: int, bandwidth: float, remote: bool = True
) -> float:
    """T of the module docstring: one sync step of one trainer, every process on its own cores."""
    b = costs.batch_size
    # A trainer's NIC carries its own rows; a shard's carries N/M trainers' worth.
    wire = (
        max(1.0, trainers / shards)
        * b
        * (costs.bytes_pulled_per_sample + costs.bytes_pushed_per_sample)
        / bandwidth
    )
    shard = trainers * b * costs.shard_seconds_per_sample / shards
    allreduce = 2 * (trainers - 1) / trainers * 4 * costs.dense_parameters / bandwidth
    rpc = 2 * costs.rpc_seconds if remote else 0.0
    return costs.trainer_seconds + rpc + wire + shard + allreduce


def predict(
    costs: StepCosts,
    *,
    trainers: int,
    shards: int,
    bandwidth: float = INFINITE_BANDWIDTH,
    shared_cores: float | None = None,
    remote: bool = True,
) -> dict[str, float]:
    """Predicted samples/s: dedicated-cores bound, shared-machine CPU bound (if `shared_cores`), and the min."""
    dedicated = (
        trainers
        * costs.batch_size
        / step_seconds(costs, trainers=trainers, shards=shards, bandwidth=bandwidth, remote=remote)
    )
    out = {"dedicated": dedicated, "predicted": dedicated}
    if shared_cores is not None:
        cpu = costs.cpu_seconds_per_sample + (costs.ray_cpu_seconds_per_sample if remote else 0.0)
        out["cpu_bound"] = shared_cores / cpu
        out["predicted"] = min(dedicated, out["cpu_bound"])
    return out
