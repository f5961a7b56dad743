"""``python -m ftcomm run`` (ftcomm/_launch.py), ``Membership.from_env`` and the DDP
user's recovery: a typed error out of ``backward()`` (``pg.raising()``) and DDP over
``ProcessGroupGloo.of(group)``."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import ftcomm
from ftcomm import c10d
from ftcomm._launch import EXIT_STOPPED
from ftcomm.testing import RankContext, run_world

ROOT = Path(__file__).resolve().parent.parent
RUN = [sys.executable, "-m", "ftcomm", "run"]


def launch(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RUN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "member.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_trains_on_when_a_member_is_killed_and_the_launcher_brings_it_back() -> None:
    """The DDP example under the launcher: m1 SIGKILLs itself at step 10; m0
    and m2 get a typed error out of backward(), recover and train on; the
    launcher restarts m1 alone, which rejoins with the state. Every step's
    gradient is the whole batch's, and all end with the same parameters."""
    done = launch("--nproc", "3", "examples/ddp_launched.py", timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = {r["member"]: r for r in map(json.loads, _json_lines(done.stdout))}
    assert sorted(reports) == ["m0", "m1", "m2"], done.stdout
    for who in ("m0", "m2"):
        assert reports[who]["life"] == 0
        assert reports[who]["errors"] in (["CommFailed"], ["CommAborted"]), reports[who]
        assert reports[who]["generations"][0] == 1
    assert reports["m1"]["life"] == 1  # its second life: restarted once, as m1
    assert reports["m1"]["generations"][0] > 2  # it came back into a later world
    assert all(r["wrong_steps"] == [] and r["size"] == 3 for r in reports.values()), reports
    assert len({json.dumps(r["params"]) for r in reports.values()}) == 1
    assert "m1 (pid" in done.stderr
    assert "was killed by SIGKILL: restart 1 of 3" in done.stderr
    for who, restarts in (("m0", "0 restarts"), ("m1", "1 restart"), ("m2", "0 restarts")):
        assert f"{who} done: exited 0 ({restarts})" in done.stderr
    assert "SIGTERM" not in done.stderr  # no survivor was signalled


def _json_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{")]


def test_a_member_out_of_restarts_ends_the_job_after_the_others_and_stops_none(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "m1-gave-up"
    member = script(
        tmp_path,
        f"""
        import os, signal, sys, time
        me, life = os.environ["FTCOMM_MEMBER_ID"], int(os.environ["FTCOMM_RESTART_COUNT"])
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(99))  # a signal would show
        if me == "m1":
            if life == 1:
                open({str(marker)!r}, "w").close()
            sys.exit(3)
        deadline = time.monotonic() + 30
        while not os.path.exists({str(marker)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(me, os.environ["FTCOMM_JOB"], os.environ["FTCOMM_NPROC"], flush=True)
        """,
    )
    done = launch("--nproc", "2", "--job", "j", "--max-restarts", "1", "--backoff", "0", member)
    assert done.returncode == 1, done.stderr
    assert done.stdout.split() == ["m0", "j", "2"]
    assert "m1 (pid" in done.stderr
    assert "exited 3: restart 1 of 1 in 0 s" in done.stderr
    assert "exited 3: no restarts left of 1; the others go on" in done.stderr
    assert "m0 done: exited 0 (0 restarts)" in done.stderr
    assert "m1 gave up: exited 3 (1 restart)" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_reaches_every_member_and_leaves_none_behind(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C at a terminal (SIGINT to the launcher's process group) or
    SIGTERM: each member gets that signal once, from the launcher (they are
    in groups of their own); one that ignores it is SIGKILLed after the
    grace; no restart; 130 (143)."""
    # explicit, whatever this test run inherited (a background job ignores SIGINT)
    member = _pausing(
        tmp_path, f"signal.signal({int(sig)}, signal.SIG_IGN if me == 'm1' else signal.SIG_DFL)"
    )
    with _launched(tmp_path, "--nproc", "2", "--grace", "0.5", member) as proc:
        pids = _wait_for_pids(tmp_path, ["m0", "m1"], proc)
        sent = time.monotonic()
        os.killpg(proc.pid, sig)  # what a terminal does: the whole foreground group
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_STOPPED[sig], err
    assert time.monotonic() - sent < 10.0  # the grace (0.5 s), with room for a busy machine
    assert f"{sig.name}: passed on to every member" in err
    assert f"m0 stopped: was killed by {sig.name} (0 restarts)" in err
    assert "m1 stopped: was killed by SIGKILL (0 restarts)" in err
    assert "restart 1" not in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_launcher_started_with_sighup_ignored_keeps_ignoring_it(tmp_path: Path) -> None:
    """nohup: the terminal going away stops nothing."""
    member = _pausing(tmp_path)
    with _launched(tmp_path, "--grace", "5", member, ignoring=signal.SIGHUP) as proc:
        _wait_for_pids(tmp_path, ["m0"], proc)
        proc.send_signal(signal.SIGHUP)  # ignored, as it was when the launcher started
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert "SIGHUP" not in err
    assert "m0 stopped: was killed by SIGTERM (0 restarts)" in err


def test_ctrl_c_reaches_the_members_of_a_launcher_started_in_the_background(
    tmp_path: Path,
) -> None:
    """A shell without job control starts a background job with SIGINT
    ignored: the launcher still takes Ctrl-C and passes it on (its members
    do not inherit the ignored SIGINT)."""
    member = _pausing(
        tmp_path, "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler"
    )
    launched = _launched(tmp_path, "--grace", "5", member, ignoring=signal.SIGINT, stdout=True)
    with launched as proc:
        _wait_for_pids(tmp_path, ["m0"], proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert "m0: KeyboardInterrupt" in out  # its own handling ran
    assert "m0 stopped: was killed by SIGINT (0 restarts)" in err


def test_a_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    member = _pausing(tmp_path, "signal.signal(signal.SIGINT, signal.SIG_IGN)")
    with _launched(tmp_path, "--grace", "60", member) as proc:
        _wait_for_pids(tmp_path, ["m0"], proc)
        proc.send_signal(signal.SIGINT)
        _wait_for_line(proc, "SIGINT: passed on to every member")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)  # not the 60 s grace
    assert proc.returncode == 130, err
    assert "m0 stopped: was killed by SIGKILL (0 restarts)" in err


def _wait_for_line(proc: subprocess.Popen[str], text: str, timeout: float = 30.0) -> None:
    """Read the launcher's stderr until it says ``text`` (at most ``timeout`` s).
    Raw reads: nothing is left in a buffer that select() does not see."""
    assert proc.stderr is not None
    fd, said = proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while text.encode() not in said:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(fd, 65536) if ready else b""
        assert chunk, f"the launcher never said {text!r}; it said: {said.decode()!r}"
        said += chunk


def _kill_members(where: Path) -> None:
    """SIGKILL the members whose pid files are in ``where``, if still there."""
    for pid_file in where.glob("*.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _pausing(where: Path, setup: str = "") -> str:
    """A member's script: ``setup``, its pid in ``where``, then it waits for a
    signal (and says so if that is a KeyboardInterrupt)."""
    return script(
        where,
        f"""
        import os, signal
        me = os.environ["FTCOMM_MEMBER_ID"]
        {setup}
        open(os.path.join({str(where)!r}, me + ".pid"), "w").write(str(os.getpid()))
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            print(me + ": KeyboardInterrupt", flush=True)
            raise
        """,
    )


@contextlib.contextmanager
def _launched(
    where: Path, *args: str, ignoring: signal.Signals | None = None, stdout: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """A launcher in a process group of its own, as a terminal's foreground
    job, started with ``ignoring`` ignored (as by nohup, or a background job);
    on the way out, it and the members whose pids are in ``where`` are gone."""
    # The stop signals' dispositions are set, whatever this test run inherited
    # (under nohup SIGHUP comes ignored, and exec keeps an ignored signal so).
    stops = [int(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    ignored = [] if ignoring is None else [int(ignoring)]
    wrapper = (
        "import os, signal, sys\n"
        f"for sig in {stops}: signal.signal(sig, signal.SIG_DFL)\n"
        f"for sig in {ignored}: signal.signal(sig, signal.SIG_IGN)\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    argv = [sys.executable, "-c", wrapper, *RUN[1:], *args]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE if stdout else None,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_members(where)  # a launcher killed leaves them (their own sessions)
        proc.communicate()  # its pipes closed (the members held them too)


def _wait_for_pids(where: Path, ids: list[str], proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        files = [where / f"{i}.pid" for i in ids]
        texts = [f.read_text() if f.exists() else "" for f in files]
        if all(texts):
            return [int(t) for t in texts]
        time.sleep(0.01)
    raise AssertionError(f"the members did not start (launcher: {proc.poll()})")


@pytest.mark.slow
def test_launchers_on_two_hosts_share_one_engine(tmp_path: Path, engine_addr: str) -> None:
    """One launcher per host, each given the engine (a store, or etcd): their
    members form one world (ids from the host name by default, or --id-prefix)."""
    member = script(
        tmp_path,
        """
        import asyncio, os, torch, ftcomm

        async def main():
            members = ftcomm.Membership.from_env(join_window=20)
            async with members, ftcomm.Group("gloo", timeout=30) as group:
                world = await members.join(group)
                total = await group.allreduce(torch.ones(1))
                print(members.member_id, world.size, int(total.item()), flush=True)

        asyncio.run(main())
        """,
    )
    common = ["--engine", f"{engine_addr}/jobs", "--max-size", "2", "--job", "two"]
    procs = [
        subprocess.Popen(
            [*RUN, *common, *extra, member],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for extra in ([], ["--id-prefix", "b"])
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            outs.append(out.split())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()  # and its pipes closed
    assert outs == [[f"{socket.gethostname()}-m0", "2", "2"], ["b0", "2", "2"]]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nproc", "0", "x.py"], "--nproc must be >= 1, got 0"),
        (["--min-size", "3", "--max-size", "2", "x.py"], "--min-size (3) must not exceed"),
        (["--max-restarts", "-1", "x.py"], "--max-restarts must be >= 0"),
        (["--backoff", "nan", "x.py"], "--backoff must be a number of seconds"),
        (["--engine", "http//x", "x.py"], "--engine 'http//x' has no port"),
        (["--engine", "etcd://h", "x.py"], "--engine: each endpoint must be host:port"),
        (["--id-prefix", "a b", "x.py"], "--id-prefix 'a b' must not contain whitespace"),
        (["--job", "a/b", "x.py"], "--job 'a/b' must not contain whitespace or '/'"),
        (["--nproc", "2", "--min-size", "3", "x.py"], "--min-size (3) must not exceed --nproc"),
        (["--nproc", "3", "--max-size", "2", "x.py"], "--nproc (3) exceeds --max-size (2)"),
        (["--engine", "127.0.0.1:1", "--store-host", "h", "x.py"], "--store-host is for a light"),
        (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
        (["-m", "no_such_pkg.sub"], "no module named 'no_such_pkg'"),
        (["--engine", "http://localhost", "x.py"], "a lighthouse is 'http://host:port'"),
        (["--engine", "http://h:1/x", "x.py"], "a lighthouse is 'http://host:port'"),
        (["--store-host", "h", "x.py"], "--store-host is for a lighthouse engine"),
        (["--engine", "http://h:1", "--store-host", " ", "x.py"], "--store-host must be"),
        (["no-such-script.py"], "no such script: 'no-such-script.py'"),
    ],
)
def test_bad_arguments_are_named_and_start_nothing(args: list[str], says: str) -> None:
    done = launch(*args)
    assert done.returncode == 2
    assert says in done.stderr, done.stderr


def test_from_env_reads_what_the_launcher_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ENGINE", "JOB", "MEMBER_ID", "MIN_SIZE", "MAX_SIZE", "STORE_HOST"):
        monkeypatch.delenv(f"FTCOMM_{name}", raising=False)
    with pytest.raises(ValueError, match="FTCOMM_ENGINE, FTCOMM_JOB, FTCOMM_MEMBER_ID not set"):
        ftcomm.Membership.from_env()
    monkeypatch.setenv("FTCOMM_ENGINE", "127.0.0.1:1/p")
    monkeypatch.setenv("FTCOMM_JOB", "j")
    monkeypatch.setenv("FTCOMM_MEMBER_ID", "m7")
    members = ftcomm.Membership.from_env()
    assert (members.job, members.member_id, members.min_size, members.max_size) == (
        "j",
        "m7",
        1,
        None,
    )
    monkeypatch.setenv("FTCOMM_MIN_SIZE", "2")
    monkeypatch.setenv("FTCOMM_MAX_SIZE", "4")
    members = ftcomm.Membership.from_env(max_size=3)  # an argument wins
    assert (members.min_size, members.max_size) == (2, 3)
    monkeypatch.setenv("FTCOMM_MAX_SIZE", "four")
    with pytest.raises(ValueError, match="FTCOMM_MAX_SIZE must be an int, got 'four'"):
        ftcomm.Membership.from_env()
    monkeypatch.setenv("FTCOMM_MAX_SIZE", "4")
    monkeypatch.setenv("FTCOMM_MIN_SIZE", "0")  # as Membership(min_size=0): refused
    with pytest.raises(ValueError, match="min_size must be >= 1, got 0"):
        ftcomm.Membership.from_env()


# -- typed errors out of DDP, and DDP on a group Membership configures ------------------


def test_a_view_checks_its_group() -> None:
    with pytest.raises(TypeError, match=r"group must be an ftcomm\.Group, got str"):
        c10d.ProcessGroupGloo.of("g")  # type: ignore[arg-type]
    group = ftcomm.Group("gloo")
    with pytest.raises(ValueError, match="ProcessGroupBabyGloo cannot run on a 'gloo' group"):
        c10d.ProcessGroupBabyGloo.of(group)
    with pytest.raises(ValueError, match="ProcessGroupWrapper cannot run on a 'gloo' group"):
        c10d.ProcessGroupWrapper.of(group)
    pg = c10d.ProcessGroupGloo.of(group)
    assert pg.parent is group


def test_raising_passes_on_what_is_not_the_groups_error() -> None:
    """Only a RuntimeError that names an ftcomm error, while the group is
    errored, becomes the group's error; everything else is as it was."""
    errored: list[Exception | None] = [None]
    pg = c10d.ProcessGroupGloo()
    pg.errored = lambda: errored[0]  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="CommTimeout: late") as info, pg.raising():
        raise RuntimeError("callback: CommTimeout: late")  # the group is not errored
    assert type(info.value) is RuntimeError
    errored[0] = ftcomm.CommTimeout("late", rank=0, op="allreduce", seq=3)
    errored[0].__cause__ = ftcomm.CommTimeout("the op's own", rank=0, op="allreduce", seq=3)
    with pytest.raises(RuntimeError, match="shape mismatch") as info, pg.raising():
        raise RuntimeError("shape mismatch")  # names no ftcomm error
    assert type(info.value) is RuntimeError
    with pytest.raises(KeyError), pg.raising():
        raise KeyError("x")
    own = ftcomm.CommAborted("gone")
    with pytest.raises(ftcomm.CommAborted) as caught, pg.raising():
        raise own
    assert caught.value is own
    torch_error = RuntimeError("Got the following error when running the callback: CommTimeout: x")
    for _ in range(2):  # a copy each time: errored()'s own error is not changed
        with pytest.raises(ftcomm.CommTimeout) as timed_out, pg.raising():
            raise torch_error
        assert timed_out.value is not errored[0]
        assert timed_out.value.__cause__ is torch_error
        assert torch_error.__cause__ is errored[0].__cause__  # on to the op's own error
        assert (timed_out.value.rank, timed_out.value.op, timed_out.value.seq) == (
            0,
            "allreduce",
            3,
        )
    assert str(errored[0].__cause__) == "the op's own [rank=0 op=allreduce seq=3]"


async def _hung_peer_under_ddp(ctx: RankContext) -> tuple[str, str, str, str]:
    """Rank 1 never runs backward: rank 0's gradient allreduce hits its deadline."""
    pg = c10d.ProcessGroupGloo(timeout=timedelta(seconds=30))
    pg.configure(ctx.addr("ddp"), f"r{ctx.rank}", ctx.rank, ctx.world_size)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 1), process_group=pg)
        pg.set_timeout(timedelta(seconds=0.5))
        if ctx.rank == 1:
            await ctx.wait_for("done")
            return ("", "", "", "")
        loss = model(torch.ones(2, 4)).sum()
        try:
            with pg.raising():
                loss.backward()
        except ftcomm.CommError as exc:
            ctx.signal("done")
            cause = exc.__cause__
            return (type(exc).__name__, type(cause).__name__, str(cause), str(exc))
        raise AssertionError("backward did not fail")
    finally:
        pg.shutdown()


def test_raising_gives_the_typed_error_of_a_backward_whose_peer_hangs() -> None:
    typed, cause, torch_said, text = run_world(_hung_peer_under_ddp, 2, timeout=60)[0]
    assert typed == "CommTimeout"
    # what DDP's reducer raised: the error's name and text, in a plain RuntimeError
    assert cause == "RuntimeError"
    assert "Got the following error when running the callback: CommTimeout: allreduce" in torch_said
    assert "the group is aborted (configure() it again to go on) after: allreduce" in text


def test_a_lighthouse_engine_gets_the_address_that_routes_to_it() -> None:
    from ftcomm._launch import _route_to

    assert _route_to("http://127.0.0.1:29510") == "127.0.0.1"
    assert _route_to("http://[::1]:29510/") == "::1"
    assert _route_to("http://127.0.0.1:29510/") == "127.0.0.1"


def test_the_launchers_own_failure_exits_3_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftcomm import _launch

    async def broken(*_: object) -> None:
        raise RuntimeError("a supervisor's own bug")

    monkeypatch.setattr(_launch, "_supervise", broken)
    member = script(tmp_path, "raise SystemExit(0)\n")
    assert _launch.main(["--nproc", "2", member]) == _launch.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "the launcher failed: RuntimeError: a supervisor's own bug" in err
