"""The coroutine protocol over ``__await__``, one await per driving task.

Owns :class:`TaskDriven`, the base that makes a ``Work`` (and a ``Closing``)
a ``collections.abc.Coroutine`` as well as awaitable any number of times, so
that ``asyncio.create_task(work)`` and anyio's ``tg.start_soon(group.allreduce,
t)`` take it, with an await of its own for each task that drives it. See
docs/ops.md ("A Work is an asyncio future").
"""

from __future__ import annotations

import asyncio
import threading
from asyncio import current_task
from collections.abc import Callable, Generator
from typing import Any, TypeAlias


def _task_key() -> object:
    """The asyncio task driving the object (``None`` outside a running asyncio
    loop: ``__await__`` then says what it needs)."""
    try:
        return current_task()
    except RuntimeError:
        return None


Drivers: TypeAlias = (
    "tuple[object, Generator[Any, None, Any]] | dict[object, Generator[Any, None, Any]]"
)
"""Who drives an object: ``(task, its await)`` for one task (the usual case:
no dict per op), a dict of them for several."""


_SLOTS = threading.Lock()
"""Guards every change of a ``_drivers`` slot: tasks on two threads' loops
may drive one object (a read of the slot is one load, and needs none)."""


class TaskDriven:
    """``send``/``throw``/``close`` over ``__await__``, per driving task.

    A coroutine is driven by one task; these may be driven by several
    (``create_task(work)`` twice, anyio's tasks; and, for a ``Closing``,
    ``ensure_future``, ``wait_for``, ``gather``): each driving task gets an
    await of its own, as ``await work`` would give it, so each gets the
    result, or the error. (Where a loop runs, asyncio's functions that take
    futures take a ``Work`` as a future, without a task: work.py.)

    Subclasses have a ``_drivers`` slot (``None`` until first driven) and may
    override :meth:`_cancel_before_start`.
    """

    __slots__ = ()
    _drivers: Drivers | None

    def __await__(self) -> Generator[Any, None, Any]:
        raise NotImplementedError

    def _cancel_before_start(self) -> None:
        """A task was cancelled before its first step (asyncio throws the cancel
        into a coroutine that never ran, so ``__await__``'s handlers do not see
        it): act as a cancelled await would."""

    def _driver(self, key: object) -> Generator[Any, None, Any]:
        """``key``'s await, made on its first step."""
        with _SLOTS:
            return self._driver_locked(key)

    def _driver_locked(self, key: object) -> Generator[Any, None, Any]:
        drivers = self._drivers
        if drivers is None:
            gen = self.__await__()
            self._drivers = (key, gen)  # type: ignore[misc]  # the subclass's slot
        elif type(drivers) is tuple:
            if drivers[0] is key:
                return drivers[1]
            gen = self.__await__()
            self._drivers = {drivers[0]: drivers[1], key: gen}  # type: ignore[misc]
        else:
            assert isinstance(drivers, dict)  # for mypy
            gen = drivers.get(key)  # type: ignore[assignment]
            if gen is None:
                gen = drivers[key] = self.__await__()
        return gen

    def _drop(self, key: object) -> Generator[Any, None, Any] | None:
        """Forget ``key``'s await (it ended); the await, if there was one."""
        with _SLOTS:
            return self._drop_locked(key)

    def _drop_locked(self, key: object) -> Generator[Any, None, Any] | None:
        drivers = self._drivers
        if type(drivers) is tuple:
            if drivers[0] is key:
                self._drivers = None  # type: ignore[misc]
                return drivers[1]
            return None
        if drivers is None:
            return None
        assert isinstance(drivers, dict)  # for mypy
        return drivers.pop(key, None)

    def _step(self, call: Callable[[Generator[Any, None, Any]], Any]) -> Any:
        key = _task_key()
        gen = self._driver(key)
        try:
            return call(gen)
        except BaseException:  # StopIteration (the await ended), or its error
            self._drop(key)
            # The error may be kept (an op's, in errored()) with this frame
            # in its traceback: it must not keep the object awaited (a
            # gather's ops and their results), nor the task driving it.
            del self, gen, call, key
            raise

    def send(self, value: Any) -> Any:
        """The coroutine protocol (``create_task``, anyio's ``start_soon``):
        one step of the calling task's await."""
        # _step inlined, one driver read in place: this runs once per task
        # step (1000 tasks gathered over fused ops step 1000 times or more),
        # and a closure, a dict or a call per step shows.
        try:
            key = current_task()
        except RuntimeError:
            key = None
        drivers = self._drivers
        gen = drivers[1] if type(drivers) is tuple and drivers[0] is key else self._driver(key)
        try:
            return gen.send(value)
        except BaseException:  # StopIteration (the await ended), or its error
            self._drop(key)
            del self, gen, drivers, key  # as in _step
            raise

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        """The coroutine protocol: see :meth:`send`."""
        cancel = isinstance(typ, asyncio.CancelledError) or (
            isinstance(typ, type) and issubclass(typ, asyncio.CancelledError)
        )
        if cancel and not self._driven_by(_task_key()):
            self._cancel_before_start()
        try:
            if val is None and tb is None:  # throw(exc): what asyncio calls
                return self._step(lambda gen: gen.throw(typ))
            return self._step(lambda gen: gen.throw(typ, val, tb))
        except BaseException:
            del self  # as in _step
            raise

    def _driven_by(self, key: object) -> bool:
        drivers = self._drivers
        if drivers is None:
            return False
        if type(drivers) is tuple:
            return drivers[0] is key
        return key in drivers

    def close(self) -> None:
        """The coroutine protocol: ends the calling task's await (not the op)."""
        gen = self._drop(_task_key())
        if gen is not None:
            gen.close()
