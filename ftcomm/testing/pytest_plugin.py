"""pytest plugin (entry point ``pytest11: ftcomm``): worlds and fault plans as fixtures.

Owns the fixtures ``ftcomm_world`` (a :class:`World`), ``fault_plan`` and
``ftcomm_etcd``; the parameters ``ftcomm_loop`` and ``ftcomm_backend`` (a
test that takes either runs once per event loop or backend, those of its
``ftcomm_loops`` or ``ftcomm_backends`` marker, else asyncio and uvloop,
and gloo); the markers; and the section of a failing test's report that
shows every plan its worlds ran (with its seed, so a random plan can be
replayed). See docs/testing.md, "The pytest plugin".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ..backends import BACKENDS
from ._etcd import EtcdCluster, etcd_missing
from ._faults import Fault, FaultPlan
from ._world import LOOPS, run_world

_PLANS = pytest.StashKey[list[FaultPlan]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ftcomm_loops(*loops): run the test once per event loop of its ranks "
        "(default: asyncio and uvloop)",
    )
    config.addinivalue_line(
        "markers", "ftcomm_faults(*faults): the Fault records of the test's fault_plan"
    )
    config.addinivalue_line(
        "markers",
        "ftcomm_backends(*names): run the test once per backend, as ctx.backend (default: gloo)",
    )
    config.addinivalue_line(
        "markers", "ftcomm_etcd(nodes=1): the size of the test's ftcomm_etcd cluster"
    )


def _marked(
    metafunc: pytest.Metafunc, marker: str, default: tuple[str, ...], known: tuple[str, ...]
) -> tuple[str, ...]:
    found = metafunc.definition.get_closest_marker(marker)
    names = tuple(found.args) if found is not None and found.args else default
    unknown = set(names) - set(known)
    if unknown:
        raise pytest.UsageError(f"{marker}: unknown {sorted(unknown)}; known: {', '.join(known)}")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "ftcomm_loop" in metafunc.fixturenames:
        metafunc.parametrize("ftcomm_loop", _marked(metafunc, "ftcomm_loops", LOOPS, LOOPS))
    if "ftcomm_backend" in metafunc.fixturenames:
        backends = _marked(metafunc, "ftcomm_backends", ("gloo",), BACKENDS)
        metafunc.parametrize("ftcomm_backend", backends)


class World:
    """Runs worlds for one test, with its loop and fault plan."""

    def __init__(self, node: pytest.Item, loop: str, plan: FaultPlan, backend: str) -> None:
        self._node = node
        self.loop = loop
        self.plan = plan
        self.backend = backend

    def run(
        self,
        fn: Any,
        world_size: int,
        *,
        args: tuple[Any, ...] = (),
        plan: FaultPlan | None = None,
        timeout: float = 60.0,
        mode: str = "process",
        network: bool | None = None,
    ) -> list[Any]:
        """``run_world(fn, world_size)`` with this test's loop, backend and plan.

        Args:
            fn: a module-level ``async def fn(ctx: RankContext, *args)``.
            world_size: how many ranks the world has.
            args: more positional arguments for ``fn``.
            plan: the faults to inject (default: the test's ``fault_plan``).
            timeout: the wall-clock bound on the whole world, in seconds.
            mode: ``"process"`` or ``"thread"``: ranks as processes or as
                threads (as ``run_world``'s).
            network: whether each rank is a host of its own (as
                ``run_world``'s).

        Raises:
            WorldError: a rank raised, died unexpectedly or the world hung.
            ValueError, TypeError, RuntimeError: as ``run_world``.
        """
        plan = self.plan if plan is None else plan
        self._node.stash.setdefault(_PLANS, []).append(plan)
        return run_world(
            fn,
            world_size,
            loop=self.loop,
            args=args,
            plan=plan,
            timeout=timeout,
            backend=self.backend,
            mode=mode,
            network=network,
        )


@pytest.fixture
def fault_plan(request: pytest.FixtureRequest) -> FaultPlan:
    """The test's fault plan (from ``@pytest.mark.ftcomm_faults``, else empty)."""
    marker = request.node.get_closest_marker("ftcomm_faults")
    faults: tuple[Fault, ...] = tuple(marker.args) if marker is not None else ()
    return FaultPlan(faults)


@pytest.fixture
def ftcomm_world(
    request: pytest.FixtureRequest, fault_plan: FaultPlan, ftcomm_loop: str, ftcomm_backend: str
) -> World:
    """Run worlds of spawned ranks with the test's loop, backend and fault plan."""
    return World(request.node, ftcomm_loop, fault_plan, ftcomm_backend)


@pytest.fixture
def ftcomm_etcd(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    """An etcd cluster on loopback for the test (``@pytest.mark.ftcomm_etcd(nodes=3)``
    for three nodes); skips where etcd is missing."""
    why = etcd_missing()
    if why is not None:
        pytest.skip(why)
    marker = request.node.get_closest_marker("ftcomm_etcd")
    nodes = int(marker.kwargs.get("nodes", 1)) if marker is not None else 1
    with EtcdCluster(nodes) as cluster:
        yield cluster


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    plans = item.stash.get(_PLANS, [])
    if report.failed and plans:
        report.sections.append(("ftcomm fault plans", "\n".join(map(str, plans))))
    return report
