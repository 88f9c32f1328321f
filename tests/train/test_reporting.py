"""TensorBoard summaries: the writer writes scalars into RUN_DIR/tensorboard, and creating it imports
TensorBoard without boto3 (its S3 layer), which a later `import boto3` still finds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_the_writer_starts_without_boto3_and_leaves_it_importable(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    code = (
        "import sys; from pathlib import Path; from psrec.train.reporting import summary_writer, write_scalars; "
        f"writer = summary_writer(Path({str(tmp_path)!r})); "
        "assert 'boto3' not in sys.modules, 'creating the writer imported boto3'; "
        "write_scalars(writer, 'train', {'loss': 0.5, 'step': 1}, 1); writer.close(); "
        "import boto3; assert boto3.__name__ == 'boto3'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
