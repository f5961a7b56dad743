"""The frame codec between the parent and a subprocess worker (sans-IO).

Bytes in, frames out (:class:`Decoder`); frames in, bytes out (:func:`encode`).
Nothing here touches a socket, a process or a tensor. The format is in
``docs/protocol.md``.
"""

from ._frames import DTYPES as DTYPES
from ._frames import HEADER as HEADER
from ._frames import MAGIC as MAGIC
from ._frames import MAX_PAYLOAD as MAX_PAYLOAD
from ._frames import VERSION as VERSION
from ._frames import Abort as Abort
from ._frames import Configure as Configure
from ._frames import Decoder as Decoder
from ._frames import Done as Done
from ._frames import Failed as Failed
from ._frames import Frame as Frame
from ._frames import Kind as Kind
from ._frames import Op as Op
from ._frames import Ready as Ready
from ._frames import Scalar as Scalar
from ._frames import Shutdown as Shutdown
from ._frames import TensorDesc as TensorDesc
from ._frames import encode as encode
from ._frames import encode_op as encode_op

__all__ = [
    "DTYPES",
    "HEADER",
    "MAGIC",
    "MAX_PAYLOAD",
    "VERSION",
    "Abort",
    "Configure",
    "Decoder",
    "Done",
    "Failed",
    "Frame",
    "Kind",
    "Op",
    "Ready",
    "Scalar",
    "Shutdown",
    "TensorDesc",
    "encode",
    "encode_op",
]
