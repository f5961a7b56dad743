"""Smoke test of ``python -m ftcomm bench``: it runs, exits 0 and prints ratios;
its ``--json`` and ``--plot`` outputs; how it ends torchft's subprocess groups;
the membership recovery rows (a trial of each, their table and JSON); the
chaos soak and the scale rows (their options, a tiny run of each, their
tables and JSON)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm import _bench
from ftcomm._bench import (
    chaos,
    chaos_report,
    fsdp,
    latency,
    links,
    membership,
    report,
    runner,
    scale,
    state_copy,
    torchft_rows,
)
from ftcomm.testing import etcd_missing

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _why(stderr: str) -> str:
    """The bench's own failure lines first: the loop-lag warnings a loaded
    machine prints (FTCOMM_DEBUG) can fill what a CI log shows."""
    said = [line for line in stderr.splitlines() if line.startswith("ftcomm bench")]
    return "\n".join([*said, "-- stderr's end:", stderr[-4000:]])


def _one_trial_of_each_membership_row(members: dict[str, Any]) -> None:
    """One trial per row of the store and etcd engines (torchft's rows and
    the lighthouse engine skipped; etcd where it is installed): the
    SIGKILLed member is found at once (its listener refuses), the
    SIGSTOPped one by its heartbeat (before the op deadline), and the
    survivors are back in a world of two soon after."""
    rows = members["rows"]
    engines = ["store"] if etcd_missing() else ["store", "etcd"]
    assert [(row["system"], row["fault"], row["failed"]) for row in rows] == [
        (f"ftcomm {e}", f, None) for e in engines for f in ("kill", "hang")
    ], rows
    interval = membership.HEARTBEAT_TIMEOUT / 5  # the last beat was up to one before the kill
    for kill_row, hang_row in zip(rows[::2], rows[1::2], strict=True):
        (kill,), (hang,) = kill_row["totals_ms"], hang_row["totals_ms"]
        # Up to the survivors' first allreduce: after their configure, whose store
        # connect can wait 1 s on a reverse DNS lookup (tests/conftest.py).
        assert 0 < kill / 1e3 < membership.HEARTBEAT_TIMEOUT + 2
        low, high = membership.HEARTBEAT_TIMEOUT - 2 * interval, membership.OP_DEADLINE + 2
        assert low < hang / 1e3 < high
    skipped = ["lighthouse engine skipped: --no-torchft"]
    if etcd_missing():
        skipped.append(f"etcd engine skipped: {etcd_missing()}")
    assert members["notes"] == [*skipped, "torchft Manager rows skipped: --no-torchft"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_runs_and_prints_ratios(tmp_path: Path) -> None:
    tiny = [
        "--iters",
        "240",
        "--big-iters",
        "2",
        "--big-mib",
        "1",
        "--rounds",
        "2",
        "--warmup",
        "5",
    ]
    tiny += ["--burst", "20", "--burst-iters", "2"]
    tiny += ["--recovery-samples", "1", "--no-torchft"]  # torchft's rows: make bench
    tiny += ["--with", "stats-off"]
    tiny += ["--membership-trials", "1"]
    tiny += ["--fsdp-steps", "1"]
    tiny += ["--state-mib", "8", "--state-rounds", "1", "--state-link-gbit", "0"]
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    tiny += ["--json", str(out_json), "--plot", str(out_png)]
    # Deadlines for a loaded 2-core machine, where the suite's other workers
    # start processes too: the table part took 13 s alone, 43 s beside four
    # busy loops; the whole run 28 s and 77 s.
    proc = subprocess.run(
        [sys.executable, "-m", "ftcomm", "bench", *tiny, "--timeout", "150"],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, _why(proc.stderr)
    assert "Traceback" not in proc.stderr, _why(proc.stderr)
    assert "group aborted" not in proc.stderr, proc.stderr  # the kills it does on purpose
    out = proc.stdout
    assert re.search(r"^allreduce 1xfp32\s+raw\s+\d+\.\d+\s+\d+\.\d+\s*$", out, re.M), out
    assert re.search(r"^allreduce 1xfp32\s+ftcomm\s+[\d.]+\s+[\d.]+\s+\d+\.\d+x$", out, re.M), out
    assert re.search(r"^allreduce 1xfp32\s+facade\s+[\d.]+\s+[\d.]+\s+\d+\.\d+x$", out, re.M), out
    assert re.search(r"^allreduce 1MiB fp32\s+ftcomm\s.*\(bw ratio \d+\.\d+x\)$", out, re.M), out
    for impl in ("fused", r"fused\+fg"):
        burst = rf"^20 x allreduce 1xfp32\s+{impl}\s+[\d.]+\s+[\d.]+\s+[\d.]+x "
        burst += r"\([\d.]+x (faster|slower) than raw"
        assert re.search(burst, out, re.M), out
    for impl in ("subproc", "baby", "stats-off"):
        assert re.search(rf"^allreduce 1xfp32\s+{impl}\s+[\d.]+\s+[\d.]+\s+\d+\.\d+x$", out, re.M)
    assert re.search(r"^dead worker noticed\s+\d+\.\d+\s+\d+\.\d+$", out, re.M), out
    assert re.search(r"^subproc, spare worker\s+\d+\.\d+", out, re.M), out
    assert "torchft rows skipped: --no-torchft" in out, out
    for what in (r"SIGKILL, hb 0\.3 s", r"SIGSTOP, deadline 1 s"):
        row = rf"^ftcomm store: {what}\s+\d+\.\d\s+\d+\.\d\s+-?\d+\.\d\s+-?\d+\.\d\s+1$"
        assert re.search(row, out, re.M), out
    assert "torchft Manager rows skipped: --no-torchft" in out, out
    assert re.search(r"^torch's gloo group\s+\d+\.\d\s+\d+\.\d\s*$", out, re.M), out
    assert re.search(r"^ftcomm ProcessGroupGloo\s+[\d.]+\s+[\d.]+\s+\d+\.\d\dx$", out, re.M), out
    for what in ("raw gloo send/recv in place, 1 behind", "ftcomm sync_state, 2 behind"):
        assert re.search(rf"^{what}\s+\d+\.\d+\s+\d+\.\d+", out, re.M), out
    assert "torchft's row skipped: --no-torchft" in out, out
    assert "the state copy over links of their own skipped: --state-link-gbit 0" in out, out
    assert f"json: {out_json}" in out, out
    assert f"plot: {out_png}" in out, out

    # --json: every row of the table, the same figures, the plan, the versions.
    doc = json.loads(out_json.read_text())
    _one_trial_of_each_membership_row(doc["membership"])
    assert (doc["ftcomm"], doc["torch"]) == (ftcomm.__version__, torch.__version__)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", doc["measured"]), doc["measured"]
    assert doc["commit"] is None or re.fullmatch(r"[0-9a-f]{12,}(\+dirty)?", doc["commit"])
    assert [row["impl"] for row in doc["fsdp"]["rows"]] == ["torch", "ftcomm"]
    assert doc["fsdp"]["ratio_p50"] > 0
    copy = doc["state_copy"]
    assert [r["case"] for r in copy["rows"]] == ["raw", "ftcomm", "raw x2", "ftcomm x2"]
    assert copy["ratio_to_raw"] > 0
    assert copy["two_behind_over_one"] > 0
    assert copy["links"] is None
    assert doc["plan"]["rounds"] == 2
    assert [w["iters"] for w in doc["plan"]["workloads"]] == [240, 2, 2]
    assert [w["turn"] for w in doc["plan"]["workloads"]] == [50, 1, 1]
    rows = {(r["workload"], r["case"]): r for r in doc["rows"]}
    cases = ("raw", "ftcomm", "fused", "stats-off", "verify", "facade", "subproc", "sub+move")
    cases += ("baby",)
    burst = {("20 x allreduce 1xfp32", c) for c in ("raw", "ftcomm", "fused", "fused+fg")}
    singles = {(w, c) for w in ("allreduce 1xfp32", "allreduce 1MiB fp32") for c in cases}
    assert set(rows) == singles | burst
    for (_, case), row in rows.items():
        p50_in_table = re.search(
            rf"^{re.escape(row['workload'])}\s+{re.escape(case)}\s+(\d+\.\d)\s", out, re.M
        )
        assert p50_in_table, (case, out)
        assert float(p50_in_table[1]) == pytest.approx(row["p50_us"], abs=0.051)
        assert row["p50_us"] <= row["p90_us"] <= row["p99_us"]
        raw_p50 = rows[(row["workload"], "raw")]["p50_us"]
        # rounded to 4 places: a burst row's ratio (0.03) is within 5e-5, not 1e-3 of itself
        ratio = pytest.approx(row["p50_us"] / raw_p50, rel=1e-3, abs=5e-5)
        assert row["ratio_p50_vs_raw"] == ratio
    for case in cases:  # 120 per round, in turns of 50, 50 and 20: every op timed
        assert rows[("allreduce 1xfp32", case)]["ops"] == 240, case
    assert rows[("allreduce 1MiB fp32", "ftcomm")]["gb_per_s"] > 0
    assert rows[("allreduce 1xfp32", "ftcomm")]["gb_per_s"] is None
    assert "dead worker noticed" in {r["what"] for r in doc["recovery"]}
    kinds = [(r["system"], r["fault"], r["trials"]) for r in doc["membership"]["rows"]]
    engines = ["store"] if etcd_missing() else ["store", "etcd"]
    assert kinds == [(f"ftcomm {e}", f, 1) for e in engines for f in ("kill", "hang")]
    assert doc["failures"] == []

    # --plot: a PNG of a plausible size (two panels of 7 cases).
    png = out_png.read_bytes()
    assert png[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width >= 800, width
    assert height >= 600, height
    assert len(png) > 30_000, len(png)


def test_plot_without_matplotlib_exits_2_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError

    def must_not_run(*_: object) -> runner.Report:
        raise AssertionError("the bench ran although --plot cannot be drawn")

    monkeypatch.setattr(_bench, "_run_children", must_not_run)
    assert _bench.main(["--plot", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'ftcomm[plot]'" in err, err
    assert not (tmp_path / "b.png").exists()


def test_json_to_stdout_alone_and_a_failure_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake_run(plan: runner.Plan, timeout: float) -> runner.Report:
        lat = {(w.label, c): [1e-4, 2e-4, 4e-4] for w in plan.workloads for c in plan.cases}
        return runner.Report(lat, failures=["rank 1, baby: close failed: boom"])

    monkeypatch.setattr(_bench, "_run_children", fake_run)
    argv = ["--json", "-", "--recovery-samples", "0", "--membership-trials", "0", "--no-torchft"]
    code = _bench.main([*argv, "--fsdp-steps", "0", "--state-mib", "0"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout holds the JSON alone
    assert code == 1
    assert doc["failures"] == ["rank 1, baby: close failed: boom"]
    assert "FAILED: rank 1, baby: close failed: boom" in captured.err
    assert doc["rows"][0]["case"] == "raw"
    assert doc["rows"][1]["ratio_p50_vs_raw"] == 1.0
    assert doc["recovery"] is None
    assert doc["membership"] is None
    assert doc["state_copy"] is None


class _FakeProc:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode, self.pid, self.killed = exitcode, 4242, False

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None:
        pass


class _FakePipe:
    closed = False

    def close(self) -> None:
        self.closed = True


class _FakeBaby:
    """torchft 0.2's ProcessGroupBaby, as far as the bench's shutdown reads it."""

    def __init__(self, exitcode: int | None) -> None:
        self._p, self._future_pipe = _FakeProc(exitcode), _FakePipe()
        self.order: list[str] = []

    def shutdown(self) -> None:
        self.order.append(f"shutdown (killed={self._p.killed})")


def test_torchft_worker_killed_before_its_pipes_close_and_a_dead_one_reported() -> None:
    live: Any = _FakeBaby(exitcode=None)
    torchft_rows.close_torchft_baby(live)
    assert live._future_pipe.closed
    assert live.order == ["shutdown (killed=True)"]  # killed first: it never reads an EOF

    dead: Any = _FakeBaby(exitcode=1)
    with pytest.raises(RuntimeError, match=r"exited on its own, code 1"):
        torchft_rows.close_torchft_baby(dead)
    assert dead.order == ["shutdown (killed=False)"]


def test_no_command_prints_usage_and_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ftcomm", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert "usage: python -m ftcomm" in proc.stderr


_PIN_CHECK = """
import contextlib, os, threading, torch
from ftcomm._bench.runner import pin_rank
started = threading.Event()
before = threading.Thread(target=started.wait)  # a thread started before the pin
before.start()
cpu = pin_rank(1)
seen = []
after = threading.Thread(target=lambda: seen.append(tuple(sorted(os.sched_getaffinity(0)))))
after.start()
after.join()
allowed = set(seen)
for tid in os.listdir("/proc/self/task"):
    with contextlib.suppress(ProcessLookupError):  # a thread of torch's that just ended
        allowed.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
started.set()
before.join()
print(cpu, sorted(allowed), torch.get_num_threads(), len(seen))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs os.sched_setaffinity and 2 usable CPUs",
)
def test_a_pinned_rank_and_the_threads_it_starts_run_on_one_cpu() -> None:
    """--pin: rank r gets the r-th CPU the process may use, for every thread
    it has (torch's, one started before) and the ones it starts afterwards
    (Gloo's); torch's intra-op pool is one thread."""
    expected = sorted(os.sched_getaffinity(0))[1]
    proc = subprocess.run(
        [sys.executable, "-c", _PIN_CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout == f"{expected} [({expected},)] 1 1\n"


def test_pin_is_refused_before_running_where_each_rank_cannot_have_a_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def must_not_run(*_: object) -> runner.Report:
        raise AssertionError("the bench ran although --pin cannot pin")

    monkeypatch.setattr(_bench, "_run_children", must_not_run)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert _bench.main(["--pin", "--recovery-samples", "0"]) == 2
    assert "--pin needs 2 CPUs, one per rank; this process may use 1" in capsys.readouterr().err


def test_a_pinned_run_says_so_in_its_table_and_its_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plans: list[runner.Plan] = []

    def fake_run(plan: runner.Plan, timeout: float) -> runner.Report:
        plans.append(plan)
        lat = {(w.label, c): [1e-4, 2e-4] for w in plan.workloads for c in plan.cases}
        return runner.Report(lat)

    monkeypatch.setattr(_bench, "_run_children", fake_run)
    monkeypatch.setattr(_bench, "_unpinnable", lambda: None)  # any machine
    argv = ["--pin", "--json", "-", "--recovery-samples", "0", "--membership-trials", "0"]
    argv += ["--fsdp-steps", "0", "--state-mib", "0"]
    assert _bench.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["pin"] is True
    assert [p.pin for p in plans] == [True]
    assert "each rank pinned to a CPU" in report.format_table(plans[0], runner.Report(), [])
    unpinned = runner.Plan("asyncio", 1, ("raw",), (), opens={"raw": latency._open_raw})
    assert "pinned" not in report.format_table(unpinned, runner.Report(), [])


def test_a_plan_without_an_opener_for_a_case_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match=r"no opener for the cases \['raw'\] in the plan"):
        runner.Plan("asyncio", 1, ("raw",), ())
    plan = runner.Plan("asyncio", 1, ("raw",), (), opens={"raw": latency._open_raw})
    assert hash(plan) == hash(runner.Plan("asyncio", 1, ("raw",), (), opens=dict(plan.opens)))


def test_the_small_op_row_takes_turns_every_50_ops() -> None:
    """The cases take turns within a round (see ``workloads``); a row with
    no chunk, or one smaller than a chunk, is one turn."""
    small = runner.Workload("allreduce 1xfp32", "allreduce", 1, 500, 100, chunk=50)
    assert runner._turns(small) == [50] * 10
    assert runner._turns(runner.Workload("a", "allreduce", 1, 120, 0, chunk=50)) == [50, 50, 20]
    assert runner._turns(runner.Workload("a", "allreduce", 1, 30, 0, chunk=50)) == [30]
    assert runner._turns(runner.Workload("b", "allreduce", 8, 4, 1)) == [4]


# -- membership recovery ----------------------------------------------------------------


def _rows() -> list[membership.Row]:
    return [
        membership.Row("ftcomm store", "kill", [0.31, 0.35, 0.32, 0.40, 0.33]),
        membership.Row("ftcomm store", "hang", [1.02, 1.03]),
        membership.Row(
            "torchft Manager", "kill", [0.3], failed="trial 2: TrialFailed: m1 ...\nmore"
        ),
    ]


def test_the_membership_table_shows_p50_p90_and_beyond_detection() -> None:
    text = membership.format_membership(_rows(), ["lighthouse engine skipped: not yet"])
    lines = text.splitlines()
    assert re.match(r"^what\s+p50_ms\s+p90_ms\s+beyond_p50\s+beyond_p90\s+trials$", lines[1])
    # p90 of five: between the 4th and the 5th, 0.35 + 0.6 * 0.05; beyond: less 0.3 s
    kill = r"^ftcomm store: SIGKILL, hb 0\.3 s\s+330\.0\s+380\.0\s+30\.0\s+80\.0\s+5$"
    assert re.search(kill, text, re.M), text
    hang = r"^ftcomm store: SIGSTOP, deadline 1 s\s+1025\.0\s+1029\.0\s+25\.0\s+29\.0\s+2$"
    assert re.search(hang, text, re.M), text
    failed = r"^torchft Manager: SIGKILL, hb 0\.3 s\s+FAILED: trial 2: TrialFailed: m1 \.\.\.$"
    assert re.search(failed, text, re.M), text
    assert lines[-1] == "note: lighthouse engine skipped: not yet"

    doc = membership.membership_json(_rows(), [])
    assert (doc["heartbeat_timeout_s"], doc["op_deadline_s"]) == (0.3, 1.0)
    first = doc["rows"][0]
    assert (first["p50_ms"], first["p90_ms"]) == (330.0, 380.0)
    assert (first["beyond_p50_ms"], first["beyond_p90_ms"]) == (30.0, 80.0)
    assert first["totals_ms"] == [310.0, 350.0, 320.0, 400.0, 330.0]
    assert "p50_ms" not in doc["rows"][2]  # failed: no figures
    assert doc["rows"][2]["failed"].startswith("trial 2")


def test_a_failed_membership_row_is_reported_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[tuple[int, str, str | None]] = []

    def fake_measure(
        trials: int, loop: str, torchft_skip: str | None
    ) -> tuple[list[membership.Row], list[str]]:
        asked.append((trials, loop, torchft_skip))
        return _rows(), ["a note"]

    def fake_run(plan: runner.Plan, timeout: float) -> runner.Report:
        return runner.Report({(w.label, c): [1e-4] for w in plan.workloads for c in plan.cases})

    monkeypatch.setattr(_bench, "_run_children", fake_run)
    monkeypatch.setattr(_bench, "measure", fake_measure)
    argv = ["--loop", "asyncio", "--recovery-samples", "0", "--no-torchft", "--fsdp-steps", "0"]
    code = _bench.main([*argv, "--membership-trials", "7", "--json", "-", "--state-mib", "0"])
    captured = capsys.readouterr()
    assert code == 1
    assert asked == [(7, "asyncio", "--no-torchft")]
    doc = json.loads(captured.out)
    assert [r["what"] for r in doc["membership"]["rows"]][:2] == [
        "ftcomm store: SIGKILL, hb 0.3 s",
        "ftcomm store: SIGSTOP, deadline 1 s",
    ]
    assert doc["membership"]["notes"] == ["a note"]
    assert doc["failures"] == [
        "membership: torchft Manager: SIGKILL, hb 0.3 s: trial 2: TrialFailed: m1 ...\nmore"
    ]
    assert "ftcomm bench: membership: torchft Manager: SIGKILL" in captured.err


def test_an_engine_whose_module_is_not_there_is_skipped_with_a_note() -> None:
    """Adding an engine is a line of ENGINES; one whose module is missing is skipped."""
    assert [engine.name for engine in membership.ENGINES] == ["store", "lighthouse", "etcd"]
    assert membership.ENGINES[0].missing() is None
    assert membership.ENGINES[2].missing() == etcd_missing()  # a program, not a module
    absent = membership.Engine("nowhere", membership._serve_store, needs=("ftcomm._no_such",))
    assert absent.missing() == "ftcomm._no_such is not there (yet)"
    deeper = membership.Engine("nowhere", membership._serve_store, needs=("no_such_pkg.sub",))
    assert deeper.missing() == "no_such_pkg.sub is not there (yet)"
    assert membership._on_loopback("http://vm:4242") == "http://127.0.0.1:4242"


def test_the_fsdp2_rows_show_both_groups_and_the_ratio() -> None:
    rows = fsdp.Rows(2, 2, {"torch": [0.010, 0.012, 0.011, 0.013], "ftcomm": [0.011] * 4})
    text = fsdp.format_fsdp(rows)
    assert re.search(r"^torch's gloo group\s+11\.5\s+12\.7\s*$", text, re.M), text
    assert re.search(r"^ftcomm ProcessGroupGloo\s+11\.0\s+11\.0\s+0\.96x$", text, re.M), text
    doc = fsdp.fsdp_json(rows)
    assert doc["ratio_p50"] == pytest.approx(0.011 / 0.0115)
    assert [(r["impl"], round(r["p50_ms"], 1)) for r in doc["rows"]] == [
        ("torch", 11.5),
        ("ftcomm", 11.0),
    ]


def test_the_state_copy_rows_show_ratios_to_raw_and_the_extra_memory() -> None:
    times = {"raw": [0.4, 0.5], "ftcomm": [0.44, 0.55], "raw x2": [0.8], "ftcomm x2": [0.9]}
    rows = state_copy.Rows(1024, 2, times, {"sender": 3 << 20, "receiver": 5 << 20}, "absent")
    text = state_copy.format_state_copy(rows)
    assert re.search(r"^ftcomm sync_state, 1 behind\s+0\.495\s+2\.17\s+1\.10x$", text, re.M)
    assert "two behind take 1.82x the time of one" in text
    assert "sender 3 MiB, receiver 5 MiB" in text
    assert "(torchft's row skipped: absent)" in text
    doc = state_copy.state_copy_json(rows)
    assert doc["torchft_ratio_to_raw"] is None
    assert doc["extra_bytes"] == {"sender": 3 << 20, "receiver": 5 << 20}


@pytest.mark.skipif(links.missing() is not None, reason=str(links.missing()))
def test_the_state_copy_over_links_of_their_own_runs_and_leaves_no_namespace() -> None:
    def ours() -> list[str]:  # (other tests' namespaces come and go meanwhile)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        tag = f"ftc{os.getpid() % 100000}"
        return [line for line in listed.splitlines() if line.startswith(tag)]

    assert ours() == []
    rows = links.measure(4, 1, 2.0)
    assert rows.ratio() > 0
    assert "two behind take" in links.format_links(rows)
    assert ours() == []


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_a_rate_of_the_links_must_be_a_finite_number_at_least_zero(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _bench.parser().parse_args(["--state-link-gbit", bad])
    assert "--state-link-gbit" in capsys.readouterr().err


# -- the chaos soak and the scale rows (--chaos, --scale) --------------------------------


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)`` refuses before anything runs: exit 2, and what it said."""
    assert _bench.main(argv) == 2
    return capsys.readouterr().err


@pytest.fixture
def bench_must_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*_: object, **__: object) -> Any:
        raise AssertionError("the bench ran although its options were refused")

    for name in ("_run_children", "_soak"):
        monkeypatch.setattr(_bench, name, must_not_run)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--chaos-seconds", "5"], "--chaos-seconds needs --chaos"),
        (["--scale-sizes", "3"], "--scale-sizes needs --scale"),
        (["--chaos-state-mib", "8"], "--chaos-state-mib needs --chaos"),
        (
            ["--chaos", "--chaos-interval", "10", "--chaos-seconds", "5"],
            "--chaos-interval (10 s) must be shorter than --chaos-seconds (5 s)",
        ),
        (["--chaos", "--chaos-seconds", "8"], "no fault would strike"),  # the default rows' 10 s
        (["--scale", "--plot", "b.png"], "--plot draws the latency tables"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
@pytest.mark.usefixtures("bench_must_not_run")
def test_the_chaos_and_scale_options_are_checked_before_anything_runs(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in _refused(argv, capsys)


@pytest.mark.usefixtures("bench_must_not_run")
def test_network_chaos_is_refused_where_network_faults_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftcomm.testing import _net

    monkeypatch.setattr(_net, "network_missing", lambda: "network faults need root (namespaces)")
    err = _refused(["--chaos", "--chaos-kinds", "kill,partition"], capsys)
    assert "--chaos-kinds partition: network faults need root (namespaces)" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--chaos-kinds", "kill,bogus"],
        ["--chaos-kinds", ""],
        ["--chaos-members", "1"],
        ["--chaos-members", "33"],
        ["--chaos-state-mib", "0"],
        ["--chaos-seconds", "0"],
        ["--chaos-interval", "inf"],
        ["--chaos-interval", "nan"],
        ["--scale-sizes", "1,3"],
        ["--scale-sizes", "3,x"],
    ],
    ids=" ".join,
)
def test_bad_chaos_and_scale_values_are_refused_by_the_parser(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _bench.parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_the_chaos_kinds_and_scale_sizes_are_parsed_as_lists() -> None:
    args = _bench.parser().parse_args(["--chaos-kinds", " kill, stop ", "--scale-sizes", "3,8"])
    assert (args.chaos_kinds, args.scale_sizes) == (("kill", "stop"), (3, 8))


def test_the_chaos_rows_are_the_defaults_or_one_row_of_the_options_given() -> None:
    labels = [row.label for row in chaos.rows_for(None, None, None, torchft=True)]
    assert labels == [
        "ftcomm 3 members, kill every 10 s",
        "torchft 3 members, kill every 10 s",
        "ftcomm 4 members, kill/stop every 5 s",
        "torchft 4 members, kill/stop every 5 s",
        "ftcomm 8 members, kill every 10 s",
    ]
    targets = {row.label: row.target for row in chaos.ROWS if row.target is not None}
    assert targets == {
        "ftcomm 3 members, kill every 10 s": 0.9,
        "ftcomm 4 members, kill/stop every 5 s": 0.85,
    }
    assert [r.system for r in chaos.rows_for(None, None, None, torchft=False)] == ["ftcomm"] * 3
    one = chaos.rows_for(5, None, ("stop",), torchft=True)
    assert [(r.system, r.members, r.kinds, r.interval) for r in one] == [
        ("ftcomm", 5, ("stop",), 10.0),
        ("torchft", 5, ("stop",), 10.0),
    ]
    # no torchft row with a network kind: its replicas are not put on hosts
    net = chaos.rows_for(3, 10.0, ("kill", "partition"), torchft=True)
    assert [(r.system, r.network) for r in net] == [("ftcomm", True)]
    nothing: Any = None
    with pytest.raises(chaos.FaultUnavailable, match="strikes only in a phase"):
        chaos.KINDS["isolate"].strike(nothing, nothing)  # (run_phase's hosts strike it)


def _phase(committed: int, gaps: list[float | None], **kw: Any) -> chaos.Phase:
    faults = [chaos.Fault(10.0 * (i + 1), "kill", f"m{i}", 1, gap) for i, gap in enumerate(gaps)]
    return chaos.Phase(60.0, committed, generations=2 * len(gaps), faults=faults, **kw)


def _chaos_rows() -> list[chaos.Row]:
    ftcomm_3, tft_4 = chaos.ROWS[0], chaos.ROWS[3]
    met = chaos.Row(ftcomm_3, _phase(1000, []), _phase(950, [0.3, 0.5, None, 0.4], stalled=1.2))
    stalled = _phase(800, [1.1])
    stalled.timeouts.append("generation 6 could not configure its group in time\nmore")
    missed = chaos.Row(chaos.ROWS[2], _phase(1000, []), stalled)
    failed = chaos.Row(tft_4, failed="the members ended with different parameters\nthe timeline")
    return [met, missed, failed]


def test_the_chaos_table_shows_goodput_against_its_target_gaps_and_stalls() -> None:
    text = chaos_report.format_chaos(_chaos_rows(), 60.0, 7, ["a note"])
    lines = text.splitlines()
    assert lines[0].startswith(f"chaos soak: {chaos.STATE_MIB} MiB of fp32 parameters")
    assert "seed 7" in lines[0]
    assert lines[1].split() == [
        "system", "n", "faults", "every", "steps", "w/faults", "goodput", "target", "gap_p50",
        "gap_p90", "gap_max", "stalled", "faults", "gens", "evict", "clean", "same",
    ]  # fmt: skip
    # the gaps of the three faults that had a next good step: 0.3, 0.4, 0.5 s
    met = r"^ftcomm\s+3 kill\s+10s\s+1000\s+950\s+0\.950 >= 0\.90 ok\s+400\s+480\s+500\s+1\.20s"
    assert re.search(met + r"\s+4\s+8\s+0\s+0/0\s+yes$", text, re.M), text
    missed = r"^ftcomm\s+4 kill/stop\s+5s\s+1000\s+800\s+0\.800 >= 0\.85 MISSED\s+1100"
    assert re.search(missed, text, re.M), text
    failed = r"^torchft\s+4 kill/stop\s+5s FAILED: the members ended with different parameters$"
    assert re.search(failed, text, re.M), text
    stall = "stall: ftcomm 4 members, kill/stop every 5 s, with faults: a call ran out of time: "
    assert stall + "generation 6 could not configure its group in time" in lines
    assert lines[-1] == "note: a note"

    doc = chaos_report.chaos_json(_chaos_rows(), 60.0, 7, ["a note"])
    assert (doc["seconds"], doc["seed"], doc["state_mib"]) == (60.0, 7, chaos.STATE_MIB)
    first = doc["rows"][0]
    assert (first["goodput"], first["target"], first["target_met"]) == (0.95, 0.9, True)
    assert first["faults"]["committed_steps"] == 950
    assert [f["gap_ms"] for f in first["faults"]["faults"]] == [300.0, 500.0, None, 400.0]
    assert (first["faults"]["gap_p50_ms"], first["faults"]["gap_max_ms"]) == (400.0, 500.0)
    assert first["clean"]["faults"] == []
    assert doc["rows"][1]["target_met"] is False
    assert doc["rows"][1]["faults"]["membership_timeouts"][0].startswith("generation 6")
    assert (doc["rows"][2]["failed"], doc["rows"][2]["identical"]) == (
        "the members ended with different parameters\nthe timeline",
        None,
    )
    json.dumps(doc)


def test_the_gap_of_a_fault_ends_at_the_next_good_step_of_a_later_generation() -> None:
    log = chaos._Log()
    inc: Any = type("Inc", (), {"name": "m0"})()
    for message in (
        ("first", 1, 1.0, None),
        ("first", 1, 1.1, None),
        ("first", 2, 5.4, 4.9),  # after the fault at 5.0: the survivors'
        ("first", 2, 5.5, 4.95),
        ("first", 3, 7.0, 6.5),  # the replacement let in
    ):
        log.on(inc, message)
    assert log.gap(1, 5.0) == pytest.approx(0.5)  # the later survivor's first step
    assert log.gap(2, 5.0) == pytest.approx(2.0)  # a victim that was in generation 2
    assert log.gap(3, 5.0) is None
    # from the job's last step before a generation to its first in it, once the window began
    assert log.stalled(2.0, 10.0) == pytest.approx((5.5 - 4.95) + (7.0 - 6.5))
    assert log.stalled(6.0, 10.0) == pytest.approx(0.5)


@pytest.mark.timeout(120)
def test_a_chaos_soak_of_two_members_kills_one_and_ends_with_the_same_parameters() -> None:
    """The smallest soak's phase with faults: two members, 2 s, a SIGKILL after
    1 s; the replacement joins and takes the state; both end at one step, with
    bit-identical parameters (a phase that ends otherwise fails)."""
    from ftcomm.testing._world import _mp_context

    spec = chaos.RowSpec("ftcomm", 2, ("kill",), 1.0)
    settings = chaos.settings_for(spec, "asyncio", state_mib=1)
    assert settings.numel == 2**18  # 1 MiB of fp32 (``--chaos-state-mib 1``)
    phase = chaos.run_phase(_mp_context(), spec, settings, 2.0, 0, faults=True)
    assert [(f.kind, f.at >= 1.0) for f in phase.faults] == [("kill", True)]
    assert phase.committed > 0
    assert phase.generations >= 1  # the survivor's world, then the replacement's
    assert phase.members_at_end == 2
    row = chaos.Row(spec, clean=phase, chaos=phase)
    text = chaos_report.format_chaos([row], 2.0, 0, [], state_mib=1)
    assert text.startswith("chaos soak: 1 MiB of fp32 parameters"), text
    assert re.search(r"^ftcomm\s+2 kill\s+1s\s+\d+\s+\d+\s+1\.000\s", text, re.M), text
    doc = chaos_report.chaos_json([row], 2.0, 0, [], state_mib=1)
    assert (doc["state_mib"], doc["rows"][0]["identical"]) == (1, True)


@pytest.mark.timeout(90)
def test_a_chaos_soak_with_a_partition_evicts_the_member_cut_off_and_takes_it_back() -> None:
    """Three members, each on a host of its own; after 6 s m<k>'s host is cut
    off the others' (the store still answers it) until the window ends at
    12 s: the others go on without it (Evicted, cut_off), it joins again once
    healed, and all end bit-identical; every namespace is gone after."""
    from ftcomm.testing._world import _mp_context

    why = chaos.network_missing("partition")
    if why is not None:
        pytest.skip(why)
    spec = chaos.RowSpec("ftcomm", 3, ("partition",), 6.0, heal=6.0)
    settings = chaos.settings_for(spec, "asyncio")
    phase = chaos.run_phase(_mp_context(), spec, settings, 12.0, 0, faults=True)
    assert [f.kind for f in phase.faults] == ["partition"]
    assert phase.faults[0].gap is not None  # the survivors stepped in a later generation
    assert phase.cut_off >= 1, phase.trace
    assert phase.evictions == phase.cut_off, phase.trace  # alive all along: cut off, not dead
    assert (phase.members_at_end, phase.committed > 0) == (3, True)
    tag = f"ftcw{os.getpid()}x"
    assert [n for n in os.listdir("/run/netns") if n.startswith(tag)] == []
    row = chaos.Row(spec, clean=phase, chaos=phase)
    text = chaos_report.format_chaos([row], 12.0, 0, [])
    assert re.search(r"^ftcomm\s+3 partition\s+6s\s+\d+\s+\d+\s+1\.000\s", text, re.M), text
    assert f"lifted after 6 s, nothing killed ({phase.cut_off} of its evictions cut off)" in text
    doc = chaos_report.chaos_json([row], 12.0, 0, [])["rows"][0]
    assert (doc["heal_s"], doc["faults"]["evictions_cut_off"]) == (6.0, phase.cut_off)


class _Store:
    """What the heartbeat thread calls, with a fixed roster of three."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return b"m0\tt0\nm1\tt1\nm2\tt2\n" if key == "roster" else desired.encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [b"t 12"] * len(keys)


def test_a_heartbeat_round_is_counted_call_by_call_and_byte_by_byte() -> None:
    counting = scale.Counting(_Store(), "hb/m0", prefix_bytes=10, rounds=2)
    store: Any = counting
    store.compare_set("roster", "x", "x")  # before the first beat: not counted
    for _ in range(3):  # three rounds begin; two are counted
        store.compare_set("hb/m0", "t 1", "t 2")
        store.compare_set("roster", "\x00missing", "\x00missing")
        store.multi_get(["hb/m1", "hb/m2"])
    assert counting.done.is_set()
    assert counting.ops == {"compare_set": 4, "multi_get": 2}
    # a round: beat (1 + 8+10+5 + 8+3 + 8+3 sent; 8+3 back), the roster read
    # (1 + 8+10+6 + 8+8 + 8+8; 8+18 back), the beats' (1 + 8 + 2 x (8+10+5); 2 x (8+4) back)
    sent = (1 + 23 + 11 + 11) + (1 + 24 + 16 + 16) + (1 + 8 + 46)
    assert (counting.sent, counting.received) == (2 * sent, 2 * (11 + 26 + 24))


def test_the_scale_table_shows_each_size_against_three_members_and_the_store_load() -> None:
    def trials(
        join: float, connect: float, kill: float, ops: float, nbytes: float
    ) -> list[scale.Trial]:
        calls = {"compare_set": ops - 1}
        return [scale.Trial(join, kill, 1.0, ops, nbytes, calls, connect=connect)] * 3

    rows = [
        scale.Row(3, trials(0.4, 0.1, 1.5, 4.0, 500.0)),
        scale.Row(32, trials(1.0, 0.5, 2.0, 4.0, 2600.0)),
        scale.Row(16, failed="16 members, trial 1: m3 failed:\nTraceback"),
    ]
    text = scale.format_scale(rows, ["took 1 s"])
    row_3 = r"^\s+3\s+400 1\.00x\s+100\s+300\s+1\.00x\s+1500 1\.00x\s+4\.0\s+500\s+60\s+7500$"
    assert re.search(row_3, text, re.M), text
    row_32 = (
        r"^\s+32\s+1000 2\.50x \(<= 2x: MISSED\)\s+500\s+500\s+1\.67x"
        r"\s+2000 1\.33x \(<= 2x: ok\)\s+4\.0\s+2600"
    )
    assert re.search(row_32, text, re.M), text
    assert re.search(r"^\s+16 FAILED: 16 members, trial 1: m3 failed:$", text, re.M), text
    assert "32 members, one round: compare_set 3" in text
    doc = scale.scale_json(rows, [])
    assert [r["members"] for r in doc["rows"]] == [3, 32, 16]
    assert doc["rows"][1]["join_vs_3"] == pytest.approx(2.5)
    assert doc["rows"][1]["after_connect_vs_3"] == pytest.approx(5 / 3)
    assert doc["rows"][1]["connect_ms"] == [500.0] * 3
    assert doc["rows"][1]["heartbeat_round"]["ops_at_store_per_s"] == pytest.approx(640.0)
    assert doc["rows"][2] == {"members": 16, "trials": 0, "failed": rows[2].failed}


@pytest.mark.timeout(60)
def test_a_scale_trial_of_two_members_joins_counts_a_round_and_recovers() -> None:
    from ftcomm.testing._world import _mp_context

    got = scale.trial(_mp_context(), 2, "asyncio", 0, rounds=2)
    assert got.join > got.connect > 0
    assert got.kill_to_good > 0
    assert got.ops_per_round >= 2  # a beat and a read of the roster at least
    assert got.bytes_per_round > 0


def _commit_of_a_copy(root: Path, package_dir: Path) -> str:
    """What ``commit()`` says for a copy of ftcomm at ``package_dir`` (its
    parent on the path), inside the git repository ``root``."""
    shutil.copytree(Path(ftcomm.__file__).parent, package_dir / "ftcomm")
    env = {**os.environ, "PYTHONPATH": str(package_dir)}
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    git += ["-c", "commit.gpgsign=false", "-c", "tag.gpgSign=false"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    subprocess.run([*git, "add", "-A"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-qm", "c"], check=True, timeout=30)
    subprocess.run([*git, "tag", "-a", "v9", "-m", "release"], check=True, timeout=30)
    out = subprocess.run(
        [sys.executable, "-c", "from ftcomm._bench.report import commit; print(commit())"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_the_bench_records_its_own_checkouts_commit_and_no_other(tmp_path: Path) -> None:
    """Review finding: ``git describe`` named a release tag, and, for a copy
    installed inside another project's repository, that project's commit."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    assert re.fullmatch(r"[0-9a-f]{12,}", _commit_of_a_copy(checkout, checkout))  # not "v9"
    project = tmp_path / "project"
    (project / "site-packages").mkdir(parents=True)
    assert _commit_of_a_copy(project, project / "site-packages") == "None"


def _tries(*outcomes: float | str) -> Callable[[int], float]:
    """A row's trials: a number is a trial's seconds, a string its failure."""
    left = list(outcomes)

    def run(n: int) -> float:
        outcome = left.pop(0)
        if isinstance(outcome, str):
            raise membership.TrialFailed(outcome)
        return outcome

    return run


EVICTED = """m2 failed:
ftcomm: membership m2: its heartbeat round took 0.43 s (timeout 0.30 s): no member is called dead
Traceback (most recent call last):
  File "membership.py", line 237, in _member_steps
ftcomm.errors.Evicted: member 'm2' was dropped from job 'bench-kill-0': generation 2 was formed \
without it (m0, m1); its heartbeat stopped or it did not come in time. join() again
""".replace("\\\n", "")


def test_a_trial_whose_survivor_was_evicted_starved_is_voided_and_run_again() -> None:
    """Seen in CI on a loaded box: a survivor whose own heartbeat came 0.4 s
    late (timeout 0.3 s) was evicted, and the whole bench failed for it."""
    row = membership._row("ftcomm store", "kill", 2, _tries(0.3, EVICTED, 0.4))
    assert (row.totals, row.voided, row.failed) == ([0.3, 0.4], 1, None)
    text = membership.format_membership([row], [])
    assert "1 trial(s) voided and run again: not set up in time, or a survivor evicted" in text
    assert membership.membership_json([row], [])["rows"][0]["voided"] == 1


@pytest.mark.parametrize(
    "outcomes",
    [
        pytest.param((EVICTED,) * (membership.VOIDS + 1), id="evicted past the voids"),
        pytest.param(("m1 failed: an allreduce of ones gave 2.0, not 3",), id="another failure"),
        pytest.param(
            (EVICTED.replace("ftcomm: membership m2: its heartbeat round took", "ftcomm:"),),
            id="evicted with its heartbeat on time",
        ),
        pytest.param(
            (EVICTED.replace("its heartbeat stopped or", "it could not exchange data; or"),),
            id="evicted for another reason",
        ),
        pytest.param((EVICTED + "\nRuntimeError: the teardown failed after it\n",), id="chained"),
    ],
)
def test_other_trial_failures_fail_the_row(outcomes: tuple[str, ...]) -> None:
    row = membership._row("ftcomm store", "kill", 1, _tries(*outcomes))
    assert row.totals == []
    assert row.failed is not None
    assert row.failed.startswith("trial 1: TrialFailed: ")


def test_a_member_keeps_its_late_heartbeat_warnings_for_its_failure() -> None:
    """What _fail sends first: the member's own warnings, as logged."""
    membership._LATE.clear()
    keep = membership._OnPurpose()
    late = logging.LogRecord(
        "ftcomm", logging.WARNING, __file__, 1,
        "ftcomm: membership %s: its heartbeat round took %.2f s (timeout %.2f s): ...",
        ("m2", 0.43, 0.3), None,
    )  # fmt: skip
    assert keep.filter(late)
    assert membership._LATE == [
        "ftcomm: membership m2: its heartbeat round took 0.43 s (timeout 0.30 s): ..."
    ]
    membership._LATE.clear()


def test_a_trial_that_was_not_set_up_in_time_is_voided_and_run_again() -> None:
    """Seen in CI on a loaded box: no first generation of three within the
    trial's 30 s (a member late for the join window); nothing was measured."""

    def run(outcomes: list[float | Exception]) -> Callable[[int], float]:
        def one(n: int) -> float:
            outcome = outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return one

    late = membership.SetupFailed("before the signal: no 'in' from m0, m1, m2 in time")
    row = membership._row("ftcomm etcd", "hang", 1, run([late, 0.5]))
    assert (row.totals, row.voided, row.failed) == ([0.5], 1, None)
    row = membership._row("ftcomm etcd", "hang", 1, run([late] * (membership.VOIDS + 1)))
    assert row.failed is not None
    assert "before the signal" in row.failed
