"""Smoke test of ``python -m ftcomm bench``: it runs, exits 0 and prints ratios;
its ``--json`` and ``--plot`` outputs; how it ends torchft's subprocess groups;
the membership recovery rows (a trial of each, their table and JSON)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm import _bench
from ftcomm._bench import fsdp, latency, links, membership, report, runner, state_copy, torchft_rows

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _why(stderr: str) -> str:
    """The bench's own failure lines first: the loop-lag warnings a loaded
    machine prints (FTCOMM_DEBUG) can fill what a CI log shows."""
    said = [line for line in stderr.splitlines() if line.startswith("ftcomm bench")]
    return "\n".join([*said, "-- stderr's end:", stderr[-4000:]])


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
    assert (doc["ftcomm"], doc["torch"]) == (ftcomm.__version__, torch.__version__)
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
    assert kinds == [("ftcomm store", "kill", 1), ("ftcomm store", "hang", 1)]
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


@pytest.mark.timeout(60)
def test_a_trial_of_each_membership_row_kills_and_stops_a_member() -> None:
    """One trial per row of the store engine (torchft's rows and the
    lighthouse engine skipped): the SIGKILLed member is found by its
    heartbeat, the SIGSTOPped one by the op deadline, and the survivors are
    back in a world of two soon after."""
    rows, notes = membership.measure(1, "asyncio", "--no-torchft")
    assert [(row.system, row.fault, row.failed) for row in rows] == [
        ("ftcomm store", "kill", None),
        ("ftcomm store", "hang", None),
    ]
    (kill,), (hang,) = rows[0].totals, rows[1].totals
    interval = membership.HEARTBEAT_TIMEOUT / 5  # the last beat was up to one before the kill
    # Up to the survivors' first allreduce: after their configure, whose store
    # connect can wait 1 s on a reverse DNS lookup (tests/conftest.py).
    assert membership.HEARTBEAT_TIMEOUT - 2 * interval < kill < membership.HEARTBEAT_TIMEOUT + 2
    assert membership.OP_DEADLINE - 0.05 < hang < membership.OP_DEADLINE + 2
    assert notes == [
        "lighthouse engine skipped: --no-torchft",
        "torchft Manager rows skipped: --no-torchft",
    ]


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
    assert [engine.name for engine in membership.ENGINES][:1] == ["store"]
    assert membership.ENGINES[0].missing() is None
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
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    rows = links.measure(4, 1, 2.0)
    assert rows.ratio() > 0
    assert "two behind take" in links.format_links(rows)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before


def test_a_rate_of_the_links_must_be_a_finite_number_at_least_zero() -> None:
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            _bench.parser().parse_args(["--state-link-gbit", bad])
