"""Every CUDA/XPU and NCCL/XCCL call the accelerator backend makes, and nothing else.

:class:`DeviceCalls` is the one seam between :mod:`.accelerator` and the
device: machines without a GPU test the backend with a fake in its place
(``tests/fake_accel.py``), whose events complete when the test says so and
whose ``abort`` unblocks them. Nothing here decides anything. A
:class:`Flavor` names what differs between NCCL and XCCL (the device type,
the native class, the environment variables). See docs/accelerators.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

log = logging.getLogger("ftcomm")


@dataclass(frozen=True)
class Flavor:
    """What tells NCCL and XCCL apart; nothing else does."""

    name: str
    """The backend's name: ``"nccl"`` or ``"xccl"``."""
    device_type: str
    """The device its tensors live on: ``"cuda"`` or ``"xpu"``."""
    native: str
    """The c10d backend class in ``torch.distributed``."""
    library: str
    """The library's name in messages."""
    nonblocking_env: str | None
    """How long a non-blocking communicator's calls may stay in progress
    before torch itself gives up (read once per process by torch; ``None``:
    the library has no non-blocking mode)."""
    watchdog_env: tuple[tuple[str, str], ...]
    """What keeps c10d's watchdog from ending the process (variable, value)."""
    real_abort: bool
    """Whether the native ``abort()`` stops the communicator (XCCL's does
    nothing in torch 2.14: aborts stay local)."""


NCCL = Flavor(
    "nccl",
    "cuda",
    "ProcessGroupNCCL",
    "NCCL",
    "TORCH_NCCL_NONBLOCKING_TIMEOUT",
    (
        # On a failed op: abort the communicator, let the process live (the
        # default, 3, rethrows on the watchdog thread: std::terminate).
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
        # The heartbeat monitor of the process's first group ends the process
        # some minutes after any group's watchdog saw an error.
        ("TORCH_NCCL_ENABLE_MONITORING", "0"),
    ),
    real_abort=True,
)
XCCL = Flavor("xccl", "xpu", "ProcessGroupXCCL", "XCCL", None, (), real_abort=False)
FLAVORS: dict[str, Flavor] = {NCCL.name: NCCL, XCCL.name: XCCL}

WATCHDOG_TIMEOUT = timedelta(days=7)
"""c10d's own op timeout (the group's ``_timeout``: NCCL ignores a per-op
one): a week, so that its watchdog never acts before ftcomm's deadline."""

FR_ENV = "TORCHFT_TRIGGER_FR_ON_ABORT"
"""``true``: dump the flight recorder's trace before each abort (torchft's switch)."""

FR_DUMP_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where torch writes flight-recorder dumps (the first set): this prefix and the rank."""

_env_lock = threading.Lock()

_LEGACY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING"}
"""The old names torch still reads, where it reads one."""

_SEQUENCE_NUMBERS = TorchVersion(torch.__version__) < "2.14"
"""torch 2.14 made ``_set_sequence_number_for_group`` a no-op that warns."""


def prepare_environment(flavor: Flavor, nonblocking_timeout: float) -> dict[str, str]:
    """Set, where the user has not, the variables torch reads when it builds
    a group; return what this call set (logged at INFO; docs/accelerators.md).

    * the non-blocking timeout: how long torch lets a communicator's call
      stay in progress (a peer that never joins) before it gives up by
      itself. torch reads it once per process, and until then no abort can
      interrupt that wait (it holds the communicator's lock): so it is the
      first configure's timeout (torch's default is 30 minutes).
    * :attr:`Flavor.watchdog_env`: c10d's watchdog must never end the
      process for an op ftcomm owns.

    A value the user set is kept as it is, and warned about once if it lets
    the watchdog end the process.
    """
    wanted = dict(flavor.watchdog_env)
    if flavor.nonblocking_env is not None:  # whole seconds: torch parses it with stoi
        wanted[flavor.nonblocking_env] = str(min(max(math.ceil(nonblocking_timeout), 1), 2**31 - 1))
    set_now: dict[str, str] = {}
    with _env_lock:
        for name, value in wanted.items():
            legacy = _LEGACY.get(name)  # torch still reads the old name
            if name not in os.environ and (legacy is None or legacy not in os.environ):
                os.environ[name] = value
                set_now[name] = value
    if set_now:
        log.info("ftcomm: set %s for %s (docs/accelerators.md)", set_now, flavor.library)
    for name, value in flavor.watchdog_env:
        legacy = _LEGACY.get(name)
        current = os.environ.get(name, os.environ.get(legacy) if legacy else None)
        if current not in (value, "0"):
            _warn_teardown(name, current or "", value)
    cached = flavor.nonblocking_env and os.environ.get(flavor.nonblocking_env, "")
    if cached and cached.isdigit() and nonblocking_timeout > int(cached):
        _warn_capped(flavor.nonblocking_env or "", int(cached), nonblocking_timeout)
    return set_now


def _warn_capped(name: str, cached: int, wanted: float) -> None:
    key = f"{name}<{wanted}"
    if key in _warned:
        return
    _warned.add(key)
    log.warning(
        "ftcomm: %s=%d (read once per process by torch) caps how long a peer may "
        "take to join; this configure allows %g s: set %s before the first "
        "group to raise it (docs/accelerators.md)",
        name,
        cached,
        wanted,
        name,
    )


_warned: set[str] = set()


def _warn_teardown(name: str, value: str, ours: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    log.warning(
        "ftcomm: %s=%s can let c10d end the process when an op fails; ftcomm "
        "recovers from such failures itself: set it to %s (docs/accelerators.md)",
        name,
        value,
        ours,
    )


class DeviceCalls:
    """The real device and library calls for one :class:`Flavor`.

    Tests replace an instance of this (:func:`device_calls`), never the
    backend's logic.
    """

    def __init__(self, flavor: Flavor) -> None:
        self.flavor = flavor
        self.device_type = flavor.device_type
        self._module: Any = getattr(torch, flavor.device_type, None)
        self._streams: dict[int, Any] = {}

    # -- what is there ------------------------------------------------------
    def available(self) -> bool:
        """Whether torch was built with this library and sees a device."""
        native = getattr(dist, self.flavor.native, None)
        module = self._module
        return native is not None and module is not None and bool(module.is_available())

    def current_index(self) -> int:
        """The calling thread's current device index (``set_device``)."""
        return int(self._module.current_device())

    def device(self, index: int | None) -> torch.device:
        """Device ``index``, or the calling thread's current one."""
        return torch.device(self.device_type, self.current_index() if index is None else index)

    def using(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` the calling thread's current one for the block."""
        manager: contextlib.AbstractContextManager[Any] = self._module.device(device)
        return manager

    # -- the native group -----------------------------------------------------
    def options(self) -> Any:
        """A fresh options object of the native backend class."""
        return getattr(dist, self.flavor.native).Options()

    def new_group(self, store: Any, rank: int, world_size: int, options: Any) -> Any:
        """The native backend (not yet connected; non-blocking construction)."""
        return getattr(dist, self.flavor.native)(store, rank, world_size, options)

    def connect(self, pg: Any, device: torch.device) -> None:
        """Start building the communicator on ``device`` (a non-blocking
        communicator is then ready at its first op)."""
        if _SEQUENCE_NUMBERS:
            pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(device)

    def abort(self, pg: Any) -> None:
        """Abort the native group (ncclCommAbort); may block: never on the owner loop."""
        pg.abort()

    def failed(self, pg: Any) -> str | None:
        """What went wrong in the native group, if its library says so, else ``None``."""
        get_error = getattr(pg, "get_error", None)
        if get_error is None:
            return None
        error = get_error()
        name = getattr(error, "name", str(error))
        return None if name == "SUCCESS" else name

    # -- streams and events ------------------------------------------------------
    def record(self, work: Any, device: torch.device) -> Any:
        """An event that completes once ``work``'s device work has: recorded on
        a stream of ftcomm's own that waits for the op, so the caller's stream
        is not ordered behind it."""
        module = self._module
        index = device.index if device.index is not None else int(module.current_device())
        stream = self._streams.get(index)
        if stream is None:
            # High priority (-1): not a pool c10d's NCCL streams draw from
            # (default priority, or -3 when asked for high priority), so that
            # their work does not wait behind a hung op here, nor this event
            # behind theirs. Other libraries' priority -1 streams may share it.
            stream = self._streams[index] = module.Stream(index, priority=-1)
        with module.stream(stream):
            work.get_future().wait()  # this stream waits for the op; the CPU does not
            event = module.Event()
            event.record(stream)
        return event

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed. Never blocks."""
        return bool(event.query())

    def join(self, event: Any, device: torch.device) -> None:
        """Make the calling thread's current stream on ``device`` wait for
        ``event`` (the CPU does not)."""
        event.wait(self._module.current_stream(device))

    def scratch(self, device: torch.device) -> torch.Tensor:
        """A one-element tensor on ``device`` (barrier's payload)."""
        return torch.zeros(1, dtype=torch.int32, device=device)

    # -- the flight recorder ------------------------------------------------------
    def dump_flight_recorder(self, rank: int) -> str | None:
        """Write the flight recorder's trace (ops in flight, with their
        stacks) to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank, in this
        process, bounded by the trace's size; the path, or ``None`` where
        torch has no in-process dump."""
        c10d: Any = torch._C._distributed_c10d
        # NCCL's own recorder first; the generic one where there is none.
        dump = getattr(c10d, f"_dump_{self.flavor.name}_trace", None) or getattr(
            c10d, "_dump_fr_trace", None
        )
        if dump is None:
            return None
        data = dump()
        prefix = next((os.environ[e] for e in FR_DUMP_ENVS if os.environ.get(e)), None)
        if prefix is None:
            cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
            prefix = os.path.join(cache, "torch", "comm_lib_trace_rank_")  # torch's default
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
        path = f"{prefix}{rank}"
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else bytes(data))
        return path


def device_calls(flavor: Flavor) -> DeviceCalls:
    """The device calls the accelerator backend uses (tests replace this function)."""
    return DeviceCalls(flavor)


def flight_recorder_wanted() -> bool:
    """Whether ``TORCHFT_TRIGGER_FR_ON_ABORT=true`` asks for a dump before aborts."""
    return os.environ.get(FR_ENV, "false").lower() in ("1", "true")


def dump_before_abort(calls: DeviceCalls, rank: int) -> None:
    """Dump the flight recorder if asked to (never raises: an abort must go on)."""
    if not flight_recorder_wanted():
        return
    try:
        path = calls.dump_flight_recorder(rank)
    except Exception:
        log.exception("ftcomm: the flight recorder dump failed; aborting all the same")
        return
    if path is None:
        log.warning("ftcomm: this torch has no in-process flight recorder dump")
    else:
        log.warning("ftcomm: flight recorder trace written to %s before the abort", path)


def coalesced(
    pg: Any, method: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], opts: Any
) -> Any:
    """The work of ``pg.method(output, input, opts)`` for every pair (a
    single-tensor op every torch since 2.7 has on the backend): the call's
    own for one pair, else that of a coalescing block around the calls,
    whose end is theirs."""
    call = getattr(pg, method)
    if len(pairs) == 1:
        return call(pairs[0][0], pairs[0][1], opts)
    pg._start_coalescing()
    try:
        for output, input_ in pairs:
            call(output, input_, opts)
    except BaseException:
        with contextlib.suppress(Exception):  # the call's error is the one to raise
            pg._end_coalescing()
        raise
    return pg._end_coalescing()
