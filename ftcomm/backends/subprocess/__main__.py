"""``python -m ftcomm.backends.subprocess FD BACKEND``: a worker (see :mod:`._worker`)."""

import os
import sys

from ._worker import main

os._exit(main(sys.argv))
