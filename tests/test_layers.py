"""The package's floors: imports point down, never in a circle, and every
module is small, says what it owns, and is on the map in docs/design.md.

Computed from the source with ``ast`` (no import runs). An import under
``if TYPE_CHECKING:`` is for annotations only and does not count; an import
inside a function does (it runs when the function does).
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterable, Iterator, Mapping

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ftcomm"
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 700
# The op core (as trio's _core/_run.py): the table of a configuration's ops
# and their records, one module in sections, share one lock and each other's
# privates; the caller's Work handle over a record, with the small internal
# API the layers above use. Past the cap by name only.
PAST_THE_CAP = {"ftcomm._runtime.table": 1000, "ftcomm._runtime.work": 800}

# The floors, lowest first. A module may import its own floor and those below
# it; within a floor, imports only must not go round in a circle. A module is
# on the floor of the longest prefix below that names it. docs/design.md
# ("The map") says the same in words.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "ftcomm.errors",
            "ftcomm._validate",
            "ftcomm._store",
            "ftcomm._etcd",
            "ftcomm._meet",
            "ftcomm._protocol",
        ),
    ),
    ("runtime", ("ftcomm._runtime",)),
    ("backends", ("ftcomm.backends",)),
    (
        "group",
        (
            "ftcomm._state",
            "ftcomm._verify",
            "ftcomm._collectives",
            "ftcomm._configure",
            "ftcomm._issue",
            "ftcomm.group",
            "ftcomm._gather",
            "ftcomm._server",
        ),
    ),
    ("facade", ("ftcomm.c10d",)),
    ("membership", ("ftcomm._membership",)),
    ("testing", ("ftcomm.testing",)),
    ("api", ("ftcomm",)),
    ("tools", ("ftcomm.__main__", "ftcomm._bench", "ftcomm._doctor", "ftcomm._launch")),
)


def module_files(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): its body is for
    annotations only. Any other test (``not TYPE_CHECKING``, ``or``) runs."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING" and ast.unparse(test.value) == "typing"
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere in the module (in a
    function, a ``try``, an ``else``), but in the body of ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)  # the else branch runs
        else:
            stack.extend(ast.iter_child_nodes(node))


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement in ``module`` names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        if not is_package:
            base.pop()
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    # ``from . import x`` names the module x where there is one, else the
    # package's own name x (import_graph settles which)
    return [f"{prefix}.{alias.name}" for alias in node.names]


def import_graph(files: Mapping[str, pathlib.Path]) -> dict[str, set[str]]:
    """Which of the package's modules each module imports (at run time)."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            for name in _imported(module, is_package, node):
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def floor_of(module: str) -> int:
    """The floor of the longest prefix that names ``module``; -1 if none.
    The top package's name (``ftcomm``) names only itself."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            below = prefix != "ftcomm" and module.startswith(prefix + ".")
            if (module == prefix or below) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    return sorted(
        f"{a} ({FLOORS[floor_of(a)][0]}) imports {b} ({FLOORS[floor_of(b)][0]})"
        for a, deps in graph.items()
        for b in deps
        if floor_of(b) > floor_of(a)
    )


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module
    (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


FILES = module_files()
GRAPH = import_graph(FILES)


def test_every_module_is_on_a_floor() -> None:
    assert [m for m in FILES if floor_of(m) < 0] == []


def test_no_import_circle() -> None:
    assert circles(GRAPH) == []


def test_imports_point_down() -> None:
    assert upward_imports(GRAPH) == []


@pytest.mark.parametrize("module", sorted(FILES))
def test_a_module_is_small_and_says_what_it_is(module: str) -> None:
    path = FILES[module]
    source = path.read_text()
    lines = source.count("\n")
    cap = PAST_THE_CAP.get(module, MAX_LINES)
    assert lines <= cap, f"{path.relative_to(ROOT)} has {lines} lines (at most {cap})"
    doc = ast.get_docstring(ast.parse(source))
    if path.stat().st_size > 400:  # a package's bare marker or a tiny main may go without
        assert doc, f"{path.relative_to(ROOT)} has no docstring saying what it owns"


def _map_name(path: pathlib.Path) -> str:
    """How the map names a module: its path under ``ftcomm/``; a package by
    its folder (``_runtime/``), but for the top one (``__init__.py``)."""
    rel = path.relative_to(PACKAGE)
    if rel.name == "__init__.py" and rel.parent != pathlib.Path("."):
        return f"{rel.parent}/"
    return str(rel)


def map_entries(text: str) -> tuple[set[str], set[str]]:
    """The modules the map names (the first word of each line of its code
    blocks) and its floors (``**name**``)."""
    found = re.search(r"^## The map\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    section = found.group(1) if found else ""
    blocks = re.findall(r"```text\n(.*?)```", section, re.S)
    names = {line.split()[0] for block in blocks for line in block.splitlines() if line.strip()}
    return names, set(re.findall(r"^\*\*(\w+)\*\*", section, re.M))


MODULE_DOCSTRING_LINES = 10


@pytest.mark.parametrize("path", sorted(FILES.values()), ids=str)
def test_a_module_docstring_says_what_the_module_owns_in_a_few_lines(path: pathlib.Path) -> None:
    # The topic's rules and rationale live in docs/ or at the class they govern.
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert doc, f"{path.relative_to(ROOT)} has no module docstring"
    lines = doc.count("\n") + 1
    assert lines <= MODULE_DOCSTRING_LINES, (
        f"{path.relative_to(ROOT)}'s module docstring has {lines} lines "
        f"(at most {MODULE_DOCSTRING_LINES})"
    )


def test_the_design_doc_is_a_map_not_a_notebook() -> None:
    # The map, a glossary and the invariants; each topic has a page of its own.
    lines = DESIGN.read_text().count("\n")
    assert lines <= 400, f"docs/design.md has {lines} lines (at most 400)"


def test_the_map_in_the_design_doc_names_every_module_and_floor() -> None:
    names, floors = map_entries(DESIGN.read_text())
    assert names, "docs/design.md has no '## The map' section with its modules"
    assert names == {_map_name(path) for path in FILES.values()}
    assert floors == {name for name, _ in FLOORS}


# -- private names stay in their module ---------------------------------------
# A reach-in: ``x._name`` in module M, where ``x`` is not ``self``/``cls`` and
# ``_name`` is not M's own (a ``def``/``class``, a module-level name, a
# ``self._name`` M assigns, or a private string M holds: ``__slots__``), but
# another ftcomm module's. Torch's (and torchft's) own privates are not
# ftcomm's: listed apart.
FOREIGN_PRIVATES = {
    ("ftcomm._bench.latency", "opts._timeout"),
    ("ftcomm._bench.latency", "opts._devices"),
    ("ftcomm.backends.accelerator", "opts._timeout"),
    ("ftcomm.backends.gloo", "opts._timeout"),
    ("ftcomm.backends.gloo", "opts._devices"),
    ("ftcomm.backends.gloo", "pg._allgather_base"),
    ("ftcomm.c10d._registry", "c10d._world"),
    ("ftcomm._membership._state_land", "result._metadata"),  # a state dict's, as torch's
    ("ftcomm.c10d._wrappers", "getattr(manager, '_pg', None)"),  # torchft's Manager's
}
# Each with a ``# reach-in:`` comment saying why, on its line or in the comment
# block just above it. Issue 40 set the bound at 10; a ratchet: it may only fall.
REACH_IN_CEILING = 5
# Private names imported from a sibling module (mostly the bench's helpers):
# a ratchet, to go down; it may only fall.
PRIVATE_IMPORT_CEILING = 44


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _slots(node: ast.AST) -> list[str]:
    """The names a ``__slots__ = (...)`` assignment lists."""
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
    ):
        return [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)]
    return []


def reach_ins(sources: Mapping[str, str]) -> list[tuple[str, int, str]]:
    """Every cross-module private access in ``sources`` (module: its text):
    (module, line, the expression). Counted: ``x._name`` and ``getattr(x,
    "_name")`` (and ``setattr``/``hasattr``), where ``_name`` is another ftcomm
    module's and not this one's own (by name: a module that has a ``_name`` of
    its own is not seen reaching for another's)."""
    own: dict[str, set[str]] = {}
    trees = {module: ast.parse(source) for module, source in sources.items()}
    for module, tree in trees.items():
        names = own.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
            names.update(str(name) for name in _slots(node))
    anywhere = set().union(*own.values())
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                args = node.args
                if node.func.id in ("getattr", "setattr", "hasattr") and len(args) >= 2:
                    name = args[1]
                    if isinstance(name, ast.Constant) and isinstance(name.value, str):
                        target = args[0]
                        mine = isinstance(target, ast.Name) and target.id in ("self", "cls")
                        attr = name.value
                        text = ast.unparse(node)
                        if (
                            _private(attr)
                            and not mine
                            and attr in anywhere - own[module]
                            and (module, text) not in FOREIGN_PRIVATES
                        ):
                            found.append((module, node.lineno, text))
                continue
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            text = ast.unparse(node)
            if node.attr in own[module] or node.attr not in anywhere:
                continue  # its own, or none of ftcomm's (torch's, the stdlib's)
            if (module, text) not in FOREIGN_PRIVATES:
                found.append((module, node.lineno, text))
    return sorted(found)


def private_imports(sources: Mapping[str, str]) -> list[tuple[str, int, str]]:
    """Every ``from mod import _name`` of another ftcomm module's private
    name (a private module itself, ``from . import _mod``, is not one)."""
    found = []
    for module, source in sources.items():
        is_package = any(other.startswith(module + ".") for other in sources)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0 and not (node.module or "").startswith("ftcomm"):
                continue  # torch's, the stdlib's
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            parts = (base, node.module or "")
            origin = node.module if node.level == 0 else ".".join(p for p in parts if p)
            for alias in node.names:
                if _private(alias.name) and f"{origin}.{alias.name}" not in sources:
                    found.append((module, node.lineno, f"{origin} import {alias.name}"))
    return sorted(found)


def said_why(lines: list[str], line: int) -> bool:
    """Whether line ``line`` (from 1) of ``lines``, or the comment block just
    above it, has a ``reach-in:`` comment."""
    at = line - 1
    if "# reach-in" in lines[at]:
        return True
    while at > 0 and lines[at - 1].lstrip().startswith("#"):
        at -= 1
        if lines[at].lstrip().startswith("# reach-in"):
            return True
    return False


def test_modules_keep_out_of_each_others_private_names() -> None:
    sources = {module: path.read_text() for module, path in FILES.items()}
    found = reach_ins(sources)
    listing = "\n".join(f"{m}:{line}: {text}" for m, line, text in found)
    assert len(found) <= REACH_IN_CEILING, f"{len(found)} reach-ins:\n{listing}"
    unsaid = [
        f"{m}:{line}: {text}"
        for m, line, text in found
        if not said_why(sources[m].splitlines(), line)
    ]
    assert unsaid == [], "reach-ins without a '# reach-in: why' comment:\n" + "\n".join(unsaid)


def test_private_names_are_imported_from_other_modules_no_more_than_before() -> None:
    found = private_imports({module: path.read_text() for module, path in FILES.items()})
    listing = "\n".join(f"{m}:{line}: from {text}" for m, line, text in found)
    assert len(found) <= PRIVATE_IMPORT_CEILING, f"{len(found)} private imports:\n{listing}"


def test_a_reach_in_is_found() -> None:
    sources = {
        "ftcomm.a": "class A:\n    def __init__(self):\n        self._x = 1\n",
        "ftcomm.b": "def f(a):\n    return a._x + a._y\n",
    }
    assert reach_ins(sources) == [("ftcomm.b", 2, "a._x")]  # _y is nobody's
    sources["ftcomm.c"] = "def g(a):\n    return getattr(a, '_x')\n"
    sources["ftcomm.d"] = "from .a import _x\nfrom . import _e\n"
    sources["ftcomm._e"] = ""
    assert reach_ins(sources)[1:] == [("ftcomm.c", 2, "getattr(a, '_x')")]
    assert private_imports(sources) == [("ftcomm.d", 1, "ftcomm.a import _x")]
    lines = ["x = 1", "# reach-in: why,", "# and more", "y = a._x", "z = a._x  # reach-in: why"]
    assert [said_why(lines, n) for n in (1, 4, 5)] == [False, True, True]


# -- the checks themselves catch what they are for --------------------------


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_an_upward_import_is_found() -> None:
    found = upward_imports({"ftcomm.errors": {"ftcomm.group"}, "ftcomm.group": {"ftcomm.errors"}})
    assert found == ["ftcomm.errors (base) imports ftcomm.group (group)"]


def test_the_graph_counts_lazy_imports_and_not_type_checking_ones(
    tmp_path: pathlib.Path,
) -> None:
    pkg = tmp_path / "ftcomm"
    (pkg / "_runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "group.py").write_text("from .errors import X\n")
    (pkg / "_runtime" / "__init__.py").write_text("")
    (pkg / "_runtime" / "work.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..group import Group\n"
        "def f():\n    from . import fuse\n"
    )
    (pkg / "_runtime" / "fuse.py").write_text("from .work import f\n")
    (pkg / "_runtime" / "loop.py").write_text(
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    pass\nelse:\n    from . import a\n"
        "if not TYPE_CHECKING:\n    from . import b\n"
        "if typing.TYPE_CHECKING:\n    from . import c\n"
        "if TYPE_CHECKING or x:\n    from . import d\n"
        "if x:\n    pass\nelif TYPE_CHECKING:\n    from . import e\nelse:\n    from . import f\n"
        "try:\n    from . import g\nexcept ImportError:\n    from . import h\n"
    )
    for name in "abcdefgh":
        (pkg / "_runtime" / f"{name}.py").write_text("")
    graph = import_graph(module_files(pkg))
    assert graph["ftcomm.group"] == {"ftcomm.errors"}
    assert graph["ftcomm._runtime.work"] == {"ftcomm._runtime.fuse"}
    assert graph["ftcomm._runtime.loop"] == {f"ftcomm._runtime.{n}" for n in "abdfgh"}
    assert circles(graph) == [["ftcomm._runtime.fuse", "ftcomm._runtime.work"]]


def test_a_module_of_no_floor_is_found() -> None:
    assert floor_of("ftcomm._brand_new") == -1
    assert floor_of("ftcomm") == [name for name, _ in FLOORS].index("api")
    assert floor_of("ftcomm._runtime.work") == 1


def test_the_map_is_read_line_by_line() -> None:
    text = "## The map\n**base** x\n```text\n_doctor/_record.py  a\n__init__.py  b\n```\n"
    text += "## Next\n```text\nlater.py  not the map's\n```\n"
    assert map_entries(text) == ({"_doctor/_record.py", "__init__.py"}, {"base"})
