"""The throughput figure of `psrec bench` (`docs/img/throughput.png`): samples/s per system, per dim.

Needs matplotlib (not a psrec dependency: `pip install matplotlib`); `plot_throughput` raises
ImportError with that hint when it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_throughput(reports: list[dict[str, Any]], path: str | Path) -> Path:
    """Two panels (wall samples/s, samples per CPU-second); grouped bars per system, one bar per report."""
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
    figure, panels = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * len(systems) + 2), 4.4))
    metrics = (
        ("samples_per_second", "ratio_to_pytorch", "wall: median samples/s"),
        (
            "samples_per_cpu_second",
            "cpu_ratio_to_pytorch",
            "samples per CPU-second (all threads + processes)",
        ),
    )
    for axes, (metric, ratio_key, title) in zip(panels, metrics, strict=True):
        for index, report in enumerate(reports):
            rates = {row["system"]: row.get(metric) for row in report["rows"]}
            ratios = {row["system"]: row.get(ratio_key) for row in report["rows"]}
            xs = [i + (index - (len(reports) - 1) / 2) * width for i in range(len(systems))]
            heights = [(rates.get(s) or 0.0) / 1000 for s in systems]
            bars = axes.bar(
                xs,
                heights,
                width,
                label=f"dim {report['workload']['dim']}, {report['workload']['threads']} thread(s)",
            )
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
        axes.set_xticklabels(systems, rotation=25, ha="right", fontsize=8)
        axes.set_ylabel("thousand samples / s")
        axes.set_title(title, fontsize=9)
        axes.legend(fontsize=8)
        axes.grid(axis="y", alpha=0.3)
    workload, machine = reports[0]["workload"], reports[0]["machine"]
    figure.suptitle(
        f"psrec bench: DLRM, batch {workload['batch_size']}, {machine['cores']} shared cores "
        f"(load ~{machine['load_average'][0]:.0f}); labels: x plain PyTorch at the same precision, same round",
        fontsize=9,
    )
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return target
