"""The pytest plugin, run the way a user's project runs it (a pytest subprocess)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

FAILING = """
import pytest
from ftcomm.testing import Fault, FaultPlan, RankContext

async def noop(ctx: RankContext) -> int:
    return ctx.rank

@pytest.mark.ftcomm_loops("asyncio")
@pytest.mark.ftcomm_faults(Fault.delay(1, 0, 0.01))
def test_fails_after_a_world(ftcomm_world, fault_plan):
    assert fault_plan == FaultPlan.of(Fault.delay(1, 0, 0.01))
    assert ftcomm_world.run(noop, 2) == [0, 1]
    assert False, "the user's own assertion"

@pytest.mark.ftcomm_loops("asyncio", "uvloop")
def test_runs_once_per_loop(ftcomm_world, ftcomm_loop):
    assert ftcomm_world.loop == ftcomm_loop

async def backend_of(ctx: RankContext) -> str:
    return ctx.backend

@pytest.mark.ftcomm_loops("asyncio")
@pytest.mark.ftcomm_backends("gloo", "dummy")
def test_runs_once_per_backend(ftcomm_world, ftcomm_backend):
    assert ftcomm_world.run(backend_of, 1) == [ftcomm_backend]
"""


@pytest.mark.slow
def test_loops_marker_and_plan_in_the_failure_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=FAILING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*ftcomm fault plans*", "FaultPlan: delay(rank 1, op 0 0.01s)"])


@pytest.mark.slow
def test_an_unknown_loop_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_user="""
import pytest

@pytest.mark.ftcomm_loops("trio")
def test_x(ftcomm_world):
    pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*ftcomm_loops: unknown*trio*"])
