"""`psrec stream`: the whole online loop (local broker, stream, continuous training, export, serving
with --follow) runs and measures freshness: every event produced while the server was up is
reflected by a served version, none is lost, and the report's figures are consistent (slow tier:
it starts a broker, a training run and a Ray Serve deployment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stream_quickstart.yaml"


@pytest.mark.slow
def test_the_stream_quickstart_runs_and_every_measured_event_is_served(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "psrec.cli", "stream", str(EXAMPLE), "--local", "--rate", "500"]
    command += ["--seconds", "15", "--json", str(report_path), "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["measured_events"] > 0 and report["unserved"] == 0
    assert report["rows_consumed"] == report["events"]  # the run trained every event, once
    fresh = report["freshness_seconds"]
    assert 0 < fresh["p50"] <= fresh["p99"] <= fresh["max"] < 60
    assert "freshness" in done.stdout
