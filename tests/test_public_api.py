from __future__ import annotations

import inspect
import pickle
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import ftcomm
import ftcomm.c10d
import ftcomm.testing


@pytest.mark.parametrize("module", [ftcomm, ftcomm.c10d, ftcomm.testing], ids=lambda m: m.__name__)
def test_every_public_name_is_exported_and_documented(module: Any) -> None:
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, tuple):  # constants such as LOOPS
            continue
        assert inspect.getdoc(obj), f"{module.__name__}.{name} has no docstring"


def test_group_methods_say_what_they_raise() -> None:
    for name, member in inspect.getmembers(ftcomm.Group):
        if name.startswith("_") or not callable(member):
            continue
        doc = inspect.getdoc(member) or ""
        if name in {"errored", "set_timeout", "num_active_work", "abort", "shutdown", "stats"}:
            assert doc, name
            continue
        assert "Raises" in doc, f"Group.{name} does not list what it raises"


def test_facade_entry_points_say_what_they_raise() -> None:
    from ftcomm import c10d

    for member in (
        c10d.ProcessGroupWrapper.configure,
        c10d.ProcessGroupGloo.size,
        c10d.ProcessGroupGloo.set_timeout,
        c10d.ProcessGroup.register,
        c10d.ProcessGroup.unregister,
        c10d.create_store_client,
        c10d.FakeProcessGroupWrapper.report_future_error,
    ):
        assert "Raises" in (inspect.getdoc(member) or ""), member.__qualname__
    for cls in (c10d.ProcessGroupDummy, c10d.ProcessGroupWrapper, c10d.ManagedProcessGroup):
        assert "Raises" in (inspect.getdoc(cls) or ""), cls.__name__


@pytest.mark.parametrize(
    "cls",
    [
        ftcomm.CommError,
        ftcomm.CommTimeout,
        ftcomm.CommAborted,
        ftcomm.CommFailed,
        ftcomm.NotConfigured,
        ftcomm.ProtocolError,
    ],
)
def test_errors_carry_context_and_pickle(cls: type[ftcomm.CommError]) -> None:
    err = cls("it broke", rank=2, op="allreduce", seq=7)
    assert isinstance(err, RuntimeError)
    assert str(err) == "it broke [rank=2 op=allreduce seq=7]"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.message, back.rank, back.op, back.seq) == ("it broke", 2, "allreduce", 7)


def test_worker_died_keeps_its_exit_status() -> None:
    err = ftcomm.WorkerDied("worker exited", exitcode=None, signal=9, rank=0)
    back = pickle.loads(pickle.dumps(err))
    assert (back.signal, back.exitcode, back.rank) == (9, None, 0)


def test_an_error_said_of_another_op_keeps_its_class_attributes_and_cause() -> None:
    cause = OSError("pipe closed")
    err = ftcomm.WorkerDied("worker exited", exitcode=None, signal=9, rank=0)
    err.__cause__ = cause
    moved = err.at(1, "broadcast", 4)
    assert type(moved) is ftcomm.WorkerDied
    assert moved is not err
    assert (moved.rank, moved.op, moved.seq, moved.signal) == (1, "broadcast", 4, 9)
    assert str(moved) == "worker exited [rank=1 op=broadcast seq=4]"
    assert moved.__cause__ is cause
    assert (err.rank, err.op, err.seq) == (0, None, None)  # the original is left as it was
    bare = err.at(None, None, None, message="gone")
    assert str(bare) == "gone"
    assert bare.signal == 9


def test_comm_timeout_is_a_timeout_error() -> None:
    assert issubclass(ftcomm.CommTimeout, TimeoutError)
    assert not issubclass(ftcomm.CommAborted, TimeoutError)


# -- the Python floor ---------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
# What the code uses that an older Python lacks, by the version that brought it.
NEWER_APIS = {
    (3, 11): (r"\basyncio\.timeout\(", r"\bTaskGroup\b", r"\bStrEnum\b", r"\btomllib\b"),
}


def _floor() -> tuple[int, int]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)", project["project"]["requires-python"])
    assert found, project["project"]["requires-python"]
    return int(found[1]), int(found[2])


def test_the_python_floor_is_the_one_the_code_needs_and_every_tool_checks() -> None:
    """requires-python is what the code runs on (it is tested on 3.11 only:
    issue 35), and ruff, mypy and the README say the same version."""
    floor = _floor()
    sources = [
        p for d in ("ftcomm", "tests", "examples", "scripts") for p in (ROOT / d).rglob("*.py")
    ]
    for version, patterns in NEWER_APIS.items():
        for path in sources:
            text = path.read_text()
            for pattern in patterns:
                if re.search(pattern, text):
                    assert floor >= version, (
                        f"{path.relative_to(ROOT)} uses {pattern}, which Python "
                        f"{version[0]}.{version[1]} brought; requires-python says {floor}"
                    )
    assert sys.version_info[:2] >= floor  # the suite runs on a Python the floor admits
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert tools["ruff"]["target-version"] == f"py{floor[0]}{floor[1]}"
    assert tools["mypy"]["python_version"] == f"{floor[0]}.{floor[1]}"
    assert f"Python >= {floor[0]}.{floor[1]})" in (ROOT / "README.md").read_text()
    assert f"Python {floor[0]}.{floor[1]} or newer" in (ROOT / "docs/running.md").read_text()
