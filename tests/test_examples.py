"""Every example config validates against today's schema (they are what users copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from psrec.config import load_config
from psrec.parallel.plan_spec import load_plan_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_config_validates(path: Path) -> None:
    if path.name.startswith("plan_"):
        assert load_plan_spec(path).tables
    else:
        assert load_config(path).model is not None


def test_frappe_examples_use_the_bars_selected_settings() -> None:
    dlrm = load_config(EXAMPLES[0].parent / "frappe_dlrm.yaml")
    assert dlrm.model.name == "dlrm" and dlrm.model.interaction == "cat"
    assert dlrm.embedding.default is not None and not dlrm.embedding.default.optimizer.lazy
