"""``python -m ftcomm.backends.subprocess FD BACKEND PARENT_PID``: a worker.

See :mod:`ftcomm.backends.subprocess._worker`.
"""

import os
import sys

from ._worker import main

os._exit(main(sys.argv))
