"""`python -m psrec.bench.hstu_pipeline_bench`: one step of 1, 2 and 4 stages runs and reports sane figures.

pytest tests/bench/test_hstu_pipeline_bench.py
"""

from __future__ import annotations

from psrec.bench import hstu_pipeline_bench as bench
from psrec.parallel.stage_planner import HSTUSize, message_bytes


def test_the_bench_reports_tokens_and_the_planners_bytes_between_stages() -> None:
    results = bench.measure(steps=1, rounds=1, num_blocks=4, stages=[1, 2, 4])
    assert set(results) == {1, 2, 4}
    assert all(result["tokens_per_second"] > 0 for result in results.values())
    assert results[1]["bytes_between_stages_per_step"] == 0
    size = HSTUSize(
        bench.DIM, bench.LENGTH, 4, bench.HEADS, bench.HEAD_DIM, bench.HEAD_DIM, num_negatives=bench.NEGATIVES
    )
    per_microbatch = message_bytes(size, bench.BATCH // bench.MICROBATCHES)
    for stages in (2, 4):
        between = results[stages]["bytes_between_stages_per_step"]
        assert between == 2 * (stages - 1) * bench.MICROBATCHES * per_microbatch
