"""The coroutine protocol over ``__await__``, one await per driving task.

A ``Work`` (and a ``Closing``) is awaitable any number of times, and also a
``collections.abc.Coroutine``, so that ``asyncio.create_task(work)`` and
anyio's ``tg.start_soon(group.allreduce, t)`` take it. A coroutine is driven
by one task; these may be driven by several (``ensure_future(work)`` twice,
``wait_for``, ``gather``): each driving task gets an await of its own, as
``await work`` would give it, so each gets the result, or the error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any


def _task_key() -> object:
    """The asyncio task driving the object (``None`` outside a running asyncio
    loop: ``__await__`` then says what it needs)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


class TaskDriven:
    """``send``/``throw``/``close`` over ``__await__``, per driving task.

    Subclasses have a ``_drivers`` slot (``None`` until first driven) and may
    override :meth:`_cancel_before_start`.
    """

    __slots__ = ()
    _drivers: dict[object, Generator[Any, None, Any]] | None

    def __await__(self) -> Generator[Any, None, Any]:
        raise NotImplementedError

    def _cancel_before_start(self) -> None:
        """A task was cancelled before its first step (asyncio throws the cancel
        into a coroutine that never ran, so ``__await__``'s handlers do not see
        it): act as a cancelled await would."""

    def _step(self, call: Callable[[Generator[Any, None, Any]], Any]) -> Any:
        key = _task_key()
        drivers = self._drivers
        if drivers is None:
            drivers = {}
            self._drivers = drivers  # type: ignore[misc]  # the subclass's slot
        gen = drivers.get(key)
        if gen is None:
            gen = drivers[key] = self.__await__()
        try:
            return call(gen)
        except BaseException:  # StopIteration (the await ended), or its error
            drivers.pop(key, None)
            raise

    def send(self, value: Any) -> Any:
        """The coroutine protocol (``create_task``, anyio's ``start_soon``):
        one step of the calling task's await."""
        # _step inlined: this runs once per task step (1000 tasks gathered
        # over fused ops step 1000 times), and a closure per step shows.
        key = _task_key()
        drivers = self._drivers
        if drivers is None:
            drivers = {}
            self._drivers = drivers  # type: ignore[misc]  # the subclass's slot
        gen = drivers.get(key)
        if gen is None:
            gen = drivers[key] = self.__await__()
        try:
            return gen.send(value)
        except BaseException:  # StopIteration (the await ended), or its error
            drivers.pop(key, None)
            raise

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        """The coroutine protocol: see :meth:`send`."""
        cancel = isinstance(typ, asyncio.CancelledError) or (
            isinstance(typ, type) and issubclass(typ, asyncio.CancelledError)
        )
        drivers = self._drivers
        if cancel and (drivers is None or _task_key() not in drivers):
            self._cancel_before_start()
        if val is None and tb is None:  # throw(exc): what asyncio calls
            return self._step(lambda gen: gen.throw(typ))
        return self._step(lambda gen: gen.throw(typ, val, tb))

    def close(self) -> None:
        """The coroutine protocol: ends the calling task's await (not the op)."""
        drivers = self._drivers
        gen = drivers.pop(_task_key(), None) if drivers is not None else None
        if gen is not None:
            gen.close()
