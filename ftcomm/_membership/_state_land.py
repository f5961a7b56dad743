"""Where each tensor of a state sent lands on a receiver. No I/O.

:func:`match` pairs a receiver's own state with the description of the state
sent (``_state_wire``): each tensor lands in the receiver's tensor at the
same place (same dtype and shape, and writable), or in a new one where the
receiver holds ``None`` or an empty container. Anything else is a
:class:`Mismatch`, located by the index of a node of the sender's tree in
pre-order (:func:`path_of` names it on any rank that holds that tree), before
a byte of a tensor moves. :func:`build` makes the state returned.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ._state_wire import (
    CONTAINERS,
    PLAIN_TAGS,
    Node,
    TensorSpec,
    local_tensor,
    plain_value,
    type_name,
    walk,
)


def path_of(tree: Node, index: int) -> str | None:
    """The place of node ``index`` (pre-order) of ``tree``, as ``state[...]``."""
    found: list[str] = []

    def visit(node: Node, path: str, counter: list[int]) -> bool:
        if counter[0] == index:
            found.append(path)
            return True
        counter[0] += 1
        tag = node[0]
        if tag in ("L", "U"):
            return any(visit(c, f"{path}[{i}]", counter) for i, c in enumerate(node[1]))
        if tag in ("D", "O"):
            for k, v in node[1]:
                if visit(v, f"{path}[{plain_value(k)!r}]", counter):
                    return True
            return (
                tag == "O" and node[2] is not None and visit(node[2], f"{path}._metadata", counter)
            )
        return False

    visit(tree, "state", [0])
    return found[0] if found else None


class Mismatch(ValueError):
    """The receiver's state and the one sent differ at node ``index``."""

    def __init__(self, code: int, index: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.index = index


SHAPE, DTYPE, KIND, KEYS, WRITE = 1, 2, 3, 4, 5
"""A mismatch's code: what differs (told to every rank)."""
WHAT = {
    SHAPE: "a shape differs",
    DTYPE: "a dtype differs",
    KIND: "a kind of value differs",
    KEYS: "the keys or a length differ",
    WRITE: "a tensor of its own cannot be written in place",
}


def _unwritable(t: torch.Tensor) -> str | None:
    """Why the values sent cannot be written into ``t`` (``None``: they can)."""
    if t.is_inference():
        return (
            "an inference tensor cannot be written in place (make the state outside "
            "torch.inference_mode(), or pass None there)"
        )
    overlap = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: torch cannot tell
    if overlap == 1 or (overlap == 2 and not _apart(tuple(t.shape), tuple(t.stride()))):
        return "its elements share memory (an expand()ed view): it cannot hold the values sent"
    return None


def _apart(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether no two elements of a layout share memory: each dimension,
    from the smallest stride up, steps past all the smaller ones span (a
    sufficient test: a layout that interleaves its dimensions fails it)."""
    span = 0
    for st, size in sorted((st, size) for size, st in zip(shape, stride, strict=True) if size > 1):
        if st <= span:
            return False
        span += (size - 1) * st
    return True


@dataclass
class Landing:
    """Where each tensor of a description lands on a receiver: ``targets[i]``
    is the receiver's tensor (its bytes, a ``DTensor``'s shard) or ``None``
    (a new one); ``leaves[i]`` what the returned state holds there."""

    targets: list[torch.Tensor | None]
    leaves: list[object]


def match(template: object, tree: Node, specs: list[TensorSpec]) -> Landing:
    """Pair the receiver's own state (already described: well formed) with
    the description of the state sent.

    Raises: Mismatch: they differ where the receiver holds something.
    """
    landing = Landing([None] * len(specs), [None] * len(specs))
    counter = [0]

    def fail(code: int, path: str, detail: str) -> Mismatch:
        return Mismatch(code, counter[0], f"{path}: {detail}")

    def visit(node: Node, mine: object, path: str, fresh: bool) -> None:
        tag = node[0]
        fresh = fresh or mine is None or (type(mine) in CONTAINERS and not mine)
        if tag == "T":
            spec = specs[node[1]]
            if not fresh:
                if not isinstance(mine, torch.Tensor):
                    raise fail(KIND, path, f"a {type_name(mine)} here, a tensor in the state sent")
                t = local_tensor(mine, path)
                if t.dtype != spec.dtype:
                    raise fail(DTYPE, path, f"dtype {t.dtype} here, {spec.dtype} in the state sent")
                if tuple(t.shape) != spec.shape:
                    raise fail(
                        SHAPE, path, f"shape {tuple(t.shape)} here, {spec.shape} in the state sent"
                    )
                unwritable = _unwritable(t)
                if unwritable is not None:
                    raise fail(WRITE, path, unwritable)
                landing.targets[node[1]] = t
                landing.leaves[node[1]] = mine
            counter[0] += 1
            return
        if tag in PLAIN_TAGS:
            if not fresh and (isinstance(mine, torch.Tensor) or type(mine) in CONTAINERS):
                raise fail(KIND, path, f"a {type_name(mine)} here, a plain value in the state sent")
            counter[0] += 1
            return
        here = counter[0]
        counter[0] += 1
        if tag in ("L", "U"):
            children = node[1]
            if not fresh and (type(mine) not in (list, tuple) or len(mine) != len(children)):  # type: ignore[arg-type]
                counter[0] = here
                raise fail(
                    KEYS,
                    path,
                    f"{_shape_of(mine)} here, a sequence of {len(children)} in the state sent",
                )
            for i, child in enumerate(children):
                visit(child, None if fresh else mine[i], f"{path}[{i}]", fresh)  # type: ignore[index]
            return
        keys = [plain_value(k) for k, _ in node[1]]
        if not fresh:
            if type(mine) not in (dict, OrderedDict):
                counter[0] = here
                raise fail(KEYS, path, f"{_shape_of(mine)} here, a mapping in the state sent")
            assert isinstance(mine, dict)
            if set(mine) != set(keys):
                counter[0] = here
                missing = [k for k in keys if k not in mine]
                extra = [k for k in mine if k not in set(keys)]
                raise fail(
                    KEYS, path, f"keys {missing} missing here, {extra} not in the state sent"
                )
        for key, (_, child) in zip(keys, node[1], strict=True):
            visit(child, None if fresh else mine[key], f"{path}[{key!r}]", fresh)  # type: ignore[index]
        if tag == "O" and node[2] is not None:
            for _ in walk(node[2]):  # plain values: taken as sent
                counter[0] += 1

    visit(tree, template, "state", False)
    return landing


def _shape_of(value: object) -> str:
    if type(value) in (list, tuple):
        return f"a {type(value).__name__} of {len(value)}"  # type: ignore[arg-type]
    return f"a {type_name(value)}"


def build(tree: Node, leaves: list[object]) -> Any:
    """The state a description's tree gives, with ``leaves[i]`` for tensor ``i``."""

    def make(node: Node) -> Any:
        tag = node[0]
        if tag == "T":
            return leaves[node[1]]
        if tag in PLAIN_TAGS:
            return plain_value(node)
        if tag == "L":
            return [make(c) for c in node[1]]
        if tag == "U":
            return tuple(make(c) for c in node[1])
        items = [(plain_value(k), make(v)) for k, v in node[1]]
        if tag == "D":
            return dict(items)
        result: OrderedDict[Any, Any] = OrderedDict(items)
        if node[2] is not None:
            result._metadata = make(node[2])  # type: ignore[attr-defined]
        return result

    return make(tree)
