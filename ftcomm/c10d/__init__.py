"""The sync facade: torchft's c10d process groups, on ftcomm's async core.

Swap ``from torchft.process_group import X`` for ``from ftcomm.c10d import X``.
Every class here is a real ``torch.distributed.ProcessGroup`` (for DDP,
``torch.distributed.*(group=pg)``, functional collectives after
``pg.register(name)``, ``init_process_group("ftcomm-gloo")`` after
``register_backends()``); its ops' ``wait()`` and future end when the op does,
at its deadline at the latest. See docs/migrating.md and docs/facade.md.
"""

from ._baby import ProcessGroupBabyGloo as ProcessGroupBabyGloo
from ._baby import ProcessGroupBabyNCCL as ProcessGroupBabyNCCL
from ._baby import ProcessGroupBabyXCCL as ProcessGroupBabyXCCL
from ._backend import register_backends as register_backends
from ._base import ProcessGroup as ProcessGroup
from ._base import create_store_client as create_store_client
from ._groups import ProcessGroupDummy as ProcessGroupDummy
from ._groups import ProcessGroupGloo as ProcessGroupGloo
from ._groups import ProcessGroupNCCL as ProcessGroupNCCL
from ._groups import ProcessGroupWrapper as ProcessGroupWrapper
from ._groups import ProcessGroupXCCL as ProcessGroupXCCL
from ._wrappers import ErrorSwallowingProcessGroupWrapper as ErrorSwallowingProcessGroupWrapper
from ._wrappers import FakeProcessGroupWrapper as FakeProcessGroupWrapper
from ._wrappers import ManagedProcessGroup as ManagedProcessGroup
from ._wrappers import Manager as Manager

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "Manager",
    "ProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ProcessGroupXCCL",
    "create_store_client",
    "register_backends",
]
