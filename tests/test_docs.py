"""Every fenced code block in README.md and docs/*.md is run, so the docs cannot rot.

One test per block, named ``file:line`` (the line of its opening fence). Every
fence carries a language tag:

- ``python``: run for real, in a fresh ``python`` (this interpreter) in an
  empty directory, with the repository on ``PYTHONPATH``; it must exit 0
  within 60 s and leave no process or ``/dev/shm`` segment behind. A block
  is a whole program (``if __name__ == "__main__":`` where it spawns).
- ``sh``: each ``python -m ftcomm ...`` line is run (``python`` is this
  interpreter) and must exit 0; ``make ...`` lines are not run (they are the
  test run itself). Any other command fails the test: mark its block skipped.
- ``text``: output, diagrams, tables of figures; not run.

A marker on the line directly before a fence changes how its block runs:

- ``<!-- docs-test: world N -->`` (python): the block is the body of a
  function run in each of N rank processes, with ``rank``, ``world_size``,
  ``store`` (``"host:port"`` of a store this test hosts) and ``prefix`` (a
  store prefix, fresh for the block) defined. For a short snippet that a
  whole program would bury.
- ``<!-- docs-test: skip REASON -->``: not run; the reason is the skip message.
  Only for what cannot run here (a GPU, a long run, the test run itself).

Line numbers in a failing block's traceback are the doc file's own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ftcomm
from ftcomm.testing._base import proc_stat, settle_fds, shm_segments

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")  # globbed at collection: new docs files are picked up
TIMEOUT = 60.0  # seconds, for a block (all of its processes together)
LANGS = ("python", "sh", "text")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*?)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<what>.*?)-->\s*$")
FTCOMM_CLI = re.compile(r"^python3? -m ftcomm(\s|$)")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a doc file."""

    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str  # the first word of the info string ("" if untagged)
    code: str  # its lines, the fence's indentation removed
    marker: str | None  # what follows "docs-test:" on the line directly before
    closed: bool = True

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def parse(path: str, text: str) -> list[Block]:
    """The fenced code blocks of a markdown text (CommonMark fences: ``` or ~~~)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        previous = MARKER.match(lines[i - 1]) if i > 0 else None
        marker = previous["what"].strip() if previous else None
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        body = lines[i + 1 : len(lines) if end is None else end]
        code = "\n".join(ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in body)
        lang = opening["info"].split()[0].lower() if opening["info"] else ""
        blocks.append(Block(path, i + 1, lang, code + "\n", marker, end is not None))
        i = len(lines) if end is None else end + 1
    return blocks


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOCS for p in ROOT.glob(pattern)})


def doc_blocks() -> list[Block]:
    return [b for p in doc_files() for b in parse(str(p.relative_to(ROOT)), p.read_text("utf-8"))]


BLOCKS = doc_blocks()


# -- running a block's processes ---------------------------------------------


def _in_session(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(entry)
            if fields[3:4] == [str(sid)] and fields[0] != "Z":
                found.append(int(entry))
    return found


def _alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def run_processes(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    """Run the processes at once, each in a session of its own; (exit code, output) each.

    Fails the test if they outlive TIMEOUT, if anything they started is still
    running once they have exited, or if they leave ftcomm shared memory behind.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    segments = shm_segments()
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for n, argv in enumerate(argvs):
            log = cwd / f"out{n}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            procs.append((proc, log))
        deadline = time.monotonic() + TIMEOUT
        for proc, _ in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                outputs = "\n".join(log.read_text(errors="replace") for _, log in procs)
                pytest.fail(f"still running after {TIMEOUT:.0f} s; output:\n{outputs}")
        # What they started (a spawned rank, multiprocessing's resource tracker)
        # gets a moment to exit after them.
        until = time.monotonic() + 5.0
        while (left := [p for proc, _ in procs for p in _in_session(proc.pid)]) and (
            time.monotonic() < until
        ):
            time.sleep(0.02)
        assert not left, f"processes left running: {left}"
        # A segment of a dead process that another test's process made (the
        # suite may run in parallel) is unlinked by that one's worker within
        # moments; one of these processes' left behind stays for good.
        leaked = settle_fds(
            lambda: {s for s in shm_segments() - segments if not _alive(s.split("-")[1])}, 2.0
        )
        assert not leaked, f"/dev/shm segments left behind: {sorted(leaked)}"
        return [(proc.returncode, log.read_text(errors="replace")) for proc, log in procs]
    finally:
        for proc, _ in procs:
            for pid in _in_session(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def check(results: list[tuple[int, str]], what: str) -> None:
    for n, (code, out) in enumerate(results):
        assert code == 0, f"{what} (process {n}) exited with {code}; output:\n{out}"


# -- the tests ----------------------------------------------------------------


def run_python(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "docs_block.py"
    # Blank lines first: a traceback's line numbers are the doc file's.
    script.write_text("\n" * block.line + block.code)
    check(run_processes([[sys.executable, script.name]], tmp_path), block.id)


def run_in_world(block: Block, world_size: int, tmp_path: Path) -> None:
    script = tmp_path / "docs_block.py"
    body = textwrap.indent(block.code, "    ") if block.code.strip() else "    pass\n"
    script.write_text(
        "\n" * (block.line - 1)
        + "def _docs_block(rank: int, world_size: int, store: str, prefix: str) -> None:\n"
        + body
        + "\n\nif __name__ == '__main__':\n"
        + "    import sys\n\n"
        + "    _docs_block(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])\n"
    )
    with ftcomm.serve_store() as server:
        argvs = [
            [sys.executable, script.name, str(r), str(world_size), server.address, "docs/q0"]
            for r in range(world_size)
        ]
        check(run_processes(argvs, tmp_path), f"{block.id}, a world of {world_size}")


def run_sh(block: Block, tmp_path: Path) -> None:
    ran = 0
    for n, raw in enumerate(block.code.splitlines(), start=block.line + 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or line.startswith("make "):
            continue  # make targets are the test run itself: not run here
        assert FTCOMM_CLI.match(line), (
            f"{block.path}:{n}: only `python -m ftcomm ...` and `make ...` lines are run; "
            f"mark the block `<!-- docs-test: skip REASON -->` if {line!r} cannot run here"
        )
        argv = [sys.executable, *shlex.split(line)[1:]]
        check(run_processes([argv], tmp_path), f"{block.path}:{n}: {line}")
        ran += 1
    assert ran, (
        f"{block.id}: an sh block that runs nothing here (only make lines): "
        "mark it `<!-- docs-test: skip REASON -->`"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: Block, tmp_path: Path) -> None:
    assert block.closed, f"{block.id}: the fence is never closed"
    assert block.lang, (
        f"{block.id}: tag the fence with its language: ```text (output, diagrams), "
        "```python or ```sh"
    )
    assert block.lang in LANGS, (
        f"{block.id}: unknown language {block.lang!r}; the docs test knows {LANGS}"
    )
    marker = block.marker
    if marker is not None and marker.split()[:1] == ["skip"]:
        reason = marker.removeprefix("skip").strip()
        assert reason, f"{block.id}: say why: <!-- docs-test: skip REASON -->"
        pytest.skip(f"{block.id}: {reason}")
    if marker is not None:
        world = re.fullmatch(r"world\s+([1-9][0-9]*)", marker)
        assert world, f"{block.id}: unknown marker {marker!r} (world N, or skip REASON)"
        assert block.lang == "python", f"{block.id}: `world N` is for python blocks"
        run_in_world(block, int(world[1]), tmp_path)
        return
    if block.lang == "python":
        run_python(block, tmp_path)
    elif block.lang == "sh":
        run_sh(block, tmp_path)


def test_every_doc_is_found() -> None:
    files = {str(p.relative_to(ROOT)) for p in doc_files()}
    assert {"README.md", "docs/testing.md", "docs/migrating.md"} <= files
    assert any(b.path == "README.md" and b.lang == "python" for b in BLOCKS)


def test_every_marker_is_directly_before_a_fence() -> None:
    """A marker a blank line away from its block would silently not apply."""
    stray = []
    for p in doc_files():
        lines = p.read_text("utf-8").splitlines()
        for n, line in enumerate(lines):
            if MARKER.match(line) and not (n + 1 < len(lines) and FENCE.match(lines[n + 1])):
                stray.append(f"{p.relative_to(ROOT)}:{n + 1}")
    assert not stray, f"docs-test markers not on the line directly before a fence: {stray}"


def test_the_parser_finds_tags_markers_and_indented_fences() -> None:
    text = (
        "intro\n```\nuntagged\n```\n<!-- docs-test: world 2 -->\n```python\nx = 1\n```\n"
        "- item\n\n  ```sh\n  make test\n  ```\n~~~~text\n```\n~~~~\n```python\nopen\n"
    )
    blocks = parse("x.md", text)
    assert [(b.line, b.lang, b.marker, b.closed) for b in blocks] == [
        (2, "", None, True),
        (6, "python", "world 2", True),
        (11, "sh", None, True),
        (14, "text", None, True),
        (17, "python", None, False),
    ]
    assert blocks[2].code == "make test\n"
    assert blocks[3].code == "```\n"


# -- docs/performance.md's bench section is docs/bench.json rendered ------------------------
def _performance_page() -> Any:
    spec = importlib.util.spec_from_file_location(
        "performance_page", ROOT / "scripts" / "performance_page.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RAW_OURS = ("raw", "ftcomm")


def test_the_performance_page_shows_the_figures_of_its_bench_json() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/performance_page.py", "--check", "docs/bench.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_performance_page_script_renders_ratios_and_refuses_what_it_cannot_place(
    tmp_path: Path,
) -> None:
    page = _performance_page()
    doc = json.loads((ROOT / "docs" / "bench.json").read_text("utf-8"))
    section = page.render(doc)
    assert section.startswith(page.BEGIN)
    assert section.endswith(page.END)
    first = doc["rows"][0]["workload"]
    raw, ours = ({r["case"]: r for r in doc["rows"] if r["workload"] == first}[c] for c in RAW_OURS)
    assert f"| raw | {page._us(raw['p50_us'])} |" in section
    assert f"| ftcomm | {page._us(ours['p50_us'])} |" in section
    assert f" {ours['ratio_p50_vs_raw']:.2f}x |" in section
    with pytest.raises(ValueError, match="no section between"):
        page.splice("# a page without the markers\n", section)
    with pytest.raises(ValueError, match="not the JSON of python -m ftcomm bench"):
        page.render({"bench": "other"})
    stale = tmp_path / "page.md"  # a page whose section is not the JSON's: --check says so
    stale.write_text(f"# p\n\n{page.BEGIN}\nold figures\n{page.END}\n", "utf-8")
    argv = ["--check", "--page", str(stale), str(ROOT / "docs" / "bench.json")]
    assert page.main(argv) == 1
    assert page.main(argv[1:]) == 0  # without --check: rewritten
    assert page.main(argv) == 0
    assert "old figures" not in stale.read_text("utf-8")
