"""torch and its backends here: torch's version and build, which of Gloo,
NCCL and XCCL this build has, the devices they would use, and what of that
is a problem (an old torch, no Gloo) or a note (no GPU, no XPU).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from ._record import JSON, Findings, Problem

MIN_TORCH = "2.7"
"""The oldest torch ftcomm supports (pyproject's ``torch>=2.7``)."""


def torch_info() -> JSON:
    """torch's version and build: CUDA or ROCm version, or ``"cpu"``; XPU or not."""
    import torch

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    xpu = getattr(torch.version, "xpu", None)
    build = f"cuda {cuda}" if cuda else f"rocm {hip}" if hip else f"xpu {xpu}" if xpu else "cpu"
    return {
        "version": torch.__version__,
        "build": build,
        "cuda": cuda,
        "hip": hip,
        "xpu": xpu,
        "git": torch.version.git_version,
    }


def _devices(module_name: str) -> tuple[bool, int]:
    """Whether torch sees a device of this kind (``cuda``, ``xpu``), and how many.

    Warnings are silenced: a CUDA build on a machine without a driver warns.
    """
    import torch

    module: Any = getattr(torch, module_name, None)
    if module is None:
        return False, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            present = bool(module.is_available())
            count = int(module.device_count()) if present else 0
        except Exception:
            return False, 0
    return present, count


def backends_info() -> JSON:
    """Each backend: in this torch build? its device present? how many? usable?"""
    import torch.distributed as dist

    from ..backends._accel_device import FLAVORS

    distributed = bool(dist.is_available())
    gloo = distributed and bool(dist.is_gloo_available())
    found: JSON = {
        "gloo": {"in_torch": gloo, "device": "cpu", "device_present": True, "devices": 1},
    }
    found["gloo"]["usable"] = gloo
    for name, flavor in FLAVORS.items():
        in_torch = distributed and getattr(dist, flavor.native, None) is not None
        present, count = _devices(flavor.device_type)
        entry: JSON = {
            "in_torch": in_torch,
            "device": flavor.device_type,
            "device_present": present,
            "devices": count,
            "usable": in_torch and present,
        }
        if name == "nccl" and in_torch:
            with contextlib.suppress(Exception):
                import torch.cuda.nccl

                nccl: Any = torch.cuda.nccl  # untyped in torch's stubs
                entry["library_version"] = ".".join(map(str, nccl.version()))
        found[name] = entry
    return found


def advise_torch(torch: JSON, backends: JSON, found: Findings) -> None:
    """Add to ``found`` what :func:`torch_info` and :func:`backends_info`
    found: a torch older than :data:`MIN_TORCH` or without Gloo is a problem;
    no NCCL or XCCL (or no device for it) is a note."""
    from torch.torch_version import TorchVersion

    tv = torch["version"]
    if TorchVersion(tv) < MIN_TORCH:
        found.problems.append(
            Problem(
                f"torch {tv} is older than {MIN_TORCH}, the oldest ftcomm supports",
                f"upgrade torch: pip install -U 'torch>={MIN_TORCH}'",
            )
        )
    if not backends["gloo"]["usable"]:
        found.problems.append(
            Problem(
                f"this torch build ({tv}) has no Gloo (torch.distributed.is_gloo_available() "
                "is False)",
                "install a torch wheel from pytorch.org (their builds have Gloo), "
                "not a build with USE_DISTRIBUTED=0 or USE_GLOO=0",
            )
        )
    for name in ("nccl", "xccl"):
        b = backends[name]
        kind = "a CUDA GPU" if name == "nccl" else "an Intel XPU"
        if not b["in_torch"]:
            found.notes.append(
                f"{name}: not in this torch build (optional: for {kind}, a torch built for it)"
            )
        elif not b["device_present"]:
            found.notes.append(
                f"{name}: in torch, but torch sees no device here (optional: for {kind})"
            )
