"""The machine a process computes on, and the dense precision ``training.dense_precision`` resolves to there.

bf16 pays only where the hardware computes it. A CPU with ``avx512_bf16`` (AMD Zen 4 and later,
Intel Cooper Lake) or AMX (``amx_bf16``, Intel Sapphire Rapids and later) runs bf16 matrix products
natively; on any other CPU oneDNN emulates them with fp32 arithmetic and conversions, and `psrec
bench`'s DLRM trained in bf16 at 0.38-0.39x of its own fp32 speed on an Intel Xeon with AVX-512F
and VNNI but neither of those (issue 42). A GPU computes bf16 where
``torch.cuda.is_bf16_supported(including_emulation=False)`` says so (Ampere and later).

So ``training.dense_precision: auto`` (the default) resolves to bf16 only on such hardware and to
fp32 elsewhere; ``fp32`` and ``bf16`` mean exactly that, and an explicit bf16 on a CPU without native
bf16 keeps bf16 with a warning saying what it costs (`resolve_dense_precision`). The trainer resolves
it where its model is built (a Ray trainer may run on another node), and the run's ``summary.json``
names the machine and the decision; ``psrec bench`` prints the machine in its header.

Everything here but the readers of ``/proc/cpuinfo`` is a pure function over plain data::

    features = isa_features()              # e.g. ['avx2', 'avx512_bf16', 'avx512_vnni', 'avx512f']
    native_bf16(features)                  # True
    resolve_dense_precision("auto", "cpu", features).resolved   # 'bf16'

``PSREC_ISA_FEATURES`` (comma-separated names of `ISA_FEATURES`; empty for none) replaces the
features read from the CPU: what ``auto`` would pick on another CPU, and a test suite whose runs
resolve the same on every machine and in every process it starts.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The ISA features that decide how fast the dense model runs on a CPU, as Linux's /proc/cpuinfo names them.
ISA_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16")  # either one: the CPU computes bf16 natively
PRECISIONS = ("auto", "fp32", "bf16")
FEATURES_VARIABLE = "PSREC_ISA_FEATURES"
CPUINFO = Path("/proc/cpuinfo")

# What an emulated bf16 costs, as measured (`psrec bench` DLRM, dim 64, batch 4096, issue 42).
EMULATED_BF16_COST = (
    "bf16 trained at 0.38-0.39x the speed of fp32 on an Intel Xeon with AVX-512F/VNNI but neither "
    "avx512_bf16 nor AMX (psrec bench, DLRM dim 64)"
)


@dataclass(frozen=True)
class DensePrecision:
    """The precision the dense model trains in: the setting, what it resolved to, and why.

    ``warning`` is set when the resolved precision runs emulated (an explicit bf16 on hardware without
    native bf16): the trainer logs it."""

    setting: str
    resolved: str
    reason: str
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """As ``summary.json`` records it: setting, resolved, reason (and warning, when there is one)."""
        record: dict[str, Any] = {"setting": self.setting, "resolved": self.resolved, "reason": self.reason}
        if self.warning is not None:
            record["warning"] = self.warning
        return record


def read_cpuinfo(path: Path = CPUINFO) -> str:
    """The text of /proc/cpuinfo, or "" where there is none (not Linux)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _first_value(cpuinfo: str, key: str) -> str | None:
    """The value of the first ``key : value`` line of `cpuinfo`, or None."""
    for line in cpuinfo.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == key:
            return value.strip()
    return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name ("AMD EPYC 9654 96-Core Processor"), from `cpuinfo` (the text of
    /proc/cpuinfo; None: this machine's); the platform's processor name, or "unknown", without one."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return _first_value(text, "model name") or platform.processor() or platform.machine() or "unknown"


def isa_features(cpuinfo: str | None = None, *, environ: dict[str, str] | None = None) -> list[str]:
    """The `ISA_FEATURES` the CPU has, in that order: from the ``flags`` line of `cpuinfo` (the text
    of /proc/cpuinfo; None: this machine's), unless `environ` (None: ``os.environ``) sets
    ``PSREC_ISA_FEATURES``, which replaces them. ValueError for a name that is not an ISA feature."""
    environ = dict(os.environ) if environ is None else environ
    override = environ.get(FEATURES_VARIABLE)
    if override is not None:
        names = {name.strip() for name in override.split(",") if name.strip()}
        unknown = sorted(names - set(ISA_FEATURES))
        if unknown:
            raise ValueError(
                f"{FEATURES_VARIABLE}: {', '.join(unknown)} not among the ISA features {', '.join(ISA_FEATURES)}"
            )
        return [name for name in ISA_FEATURES if name in names]
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    flags = set((_first_value(text, "flags") or "").split())
    return [name for name in ISA_FEATURES if name in flags]


def features_source(environ: dict[str, str] | None = None) -> str:
    """Where `isa_features` reads the features from: the variable when it is set, else /proc/cpuinfo."""
    environ = dict(os.environ) if environ is None else environ
    return FEATURES_VARIABLE if FEATURES_VARIABLE in environ else str(CPUINFO)


def native_bf16(features: Collection[str]) -> bool:
    """Does a CPU with these ISA features compute bf16 natively (``avx512_bf16`` or ``amx_bf16``)?"""
    return any(name in features for name in NATIVE_BF16_FEATURES)


def _cpu_bf16(features: Collection[str]) -> tuple[bool, str]:
    """(native bf16?, the features that say so, or that the CPU lacks them)."""
    found = [name for name in NATIVE_BF16_FEATURES if name in features]
    if found:
        return True, f"the CPU computes bf16 natively ({', '.join(found)})"
    return False, "the CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"


def resolve_dense_precision(
    setting: str, device: str, features: Collection[str], *, cuda_bf16: bool = False
) -> DensePrecision:
    """The precision the dense model trains in for ``training.dense_precision`` = `setting` on
    `device` ("cpu" or "cuda"), on a CPU with ISA `features` (`isa_features`) or a GPU that does
    (`cuda_bf16`) or does not compute bf16 natively.

    ``auto`` is bf16 where the device computes bf16 natively and fp32 elsewhere. ``fp32`` and ``bf16``
    are kept as set; bf16 on a device without native bf16 comes with a warning saying what it costs.
    """
    if setting not in PRECISIONS:
        raise ValueError(f"training.dense_precision must be one of {', '.join(PRECISIONS)}, not {setting!r}")
    if device == "cuda":
        native = cuda_bf16
        why = "the GPU computes bf16" if native else "the GPU does not compute bf16 natively"
        cost = "on such a GPU bf16 is emulated, or autocast falls back to fp32"
    elif device == "cpu":
        native, why = _cpu_bf16(features)
        cost = EMULATED_BF16_COST
    else:
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    if setting == "fp32":
        return DensePrecision(setting, "fp32", "training.dense_precision is fp32")
    if setting == "auto":
        slower = "" if native else ", where emulated bf16 is slower than fp32"
        return DensePrecision(setting, "bf16" if native else "fp32", f"auto: {why}{slower}")
    if native:
        return DensePrecision(setting, "bf16", f"training.dense_precision is bf16; {why}")
    return DensePrecision(
        setting,
        "bf16",
        f"training.dense_precision is bf16; {why}: emulated",
        warning=(
            f"training.dense_precision is bf16 but {why}: it is emulated, expect it slower than fp32 "
            f"({cost}); set training.dense_precision to auto or fp32"
        ),
    )


def describe_machine(cpuinfo: str | None = None, *, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine as ``summary.json`` and ``psrec bench`` name it: CPU model, its `ISA_FEATURES`
    (and where they were read), logical cores and architecture; `cpuinfo` None reads this machine's."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return {
        "cpu_model": cpu_model(text),
        "isa_features": isa_features(text, environ=environ),
        "isa_features_from": features_source(environ),
        "cores": os.cpu_count(),
        "architecture": platform.machine(),
    }


def summarize_trainers(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``machine`` and ``dense_precision`` from each trainer's report (``{"machine":
    describe_machine() ..., "dense_precision": DensePrecision.to_dict()}``): the first trainer's, and
    every trainer's under ``trainer_machines`` when they differ (trainers on different kinds of node)."""
    if not reports:
        return {}
    first = reports[0]
    summary = {"machine": first["machine"], "dense_precision": first["dense_precision"]}
    if any(report != first for report in reports[1:]):
        summary["trainer_machines"] = reports
    return summary


def precisions_differ(reports: list[dict[str, Any]]) -> bool:
    """Do the trainers of these reports (see `summarize_trainers`) train in different precisions?"""
    return len({report["dense_precision"]["resolved"] for report in reports}) > 1
