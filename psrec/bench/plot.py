"""The throughput figure of `psrec bench` (`docs/img/throughput.png`): samples/s per system, per dim.

Needs matplotlib (not a psrec dependency: `pip install matplotlib`); `plot_throughput` raises
ImportError with that hint when it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_throughput(reports: list[dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars: one group per system, one bar per report (e.g. dim 64 and dim 16), labelled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from error
    systems: list[str] = []
    for report in reports:
        for row in report["rows"]:
            if row["samples_per_second"] is not None and row["system"] not in systems:
                systems.append(row["system"])
    width = 0.8 / max(1, len(reports))
    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(systems) + 2), 4.2))
    for index, report in enumerate(reports):
        rates = {row["system"]: row["samples_per_second"] for row in report["rows"]}
        ratios = {row["system"]: row["ratio_to_pytorch"] for row in report["rows"]}
        xs = [i + (index - (len(reports) - 1) / 2) * width for i in range(len(systems))]
        heights = [(rates.get(s) or 0.0) / 1000 for s in systems]
        bars = axes.bar(xs, heights, width, label=f"dim {report['workload']['dim']}")
        for bar, system in zip(bars, systems, strict=True):
            ratio = ratios.get(system)
            if ratio is not None and bar.get_height() > 0:
                axes.annotate(
                    f"{ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    axes.set_xticks(range(len(systems)))
    axes.set_xticklabels(systems, rotation=20, ha="right")
    axes.set_ylabel("thousand samples / s (median)")
    workload = reports[0]["workload"]
    axes.set_title(
        f"DLRM, batch {workload['batch_size']}, {workload['threads']} threads "
        f"(labels: ratio to plain PyTorch, same round)",
        fontsize=9,
    )
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return target
