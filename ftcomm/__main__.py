"""``python -m ftcomm <command>``: the project's command-line tools.

Commands:
    bench   time ftcomm's collectives against raw torch.distributed Gloo
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """\
usage: python -m ftcomm <command> [options]

commands:
  bench   time ftcomm's collectives against raw torch.distributed Gloo
          (python -m ftcomm bench --help for its options)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; no command or an unknown one prints usage and returns 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not args or args[0] != "bench":
        if args:
            print(f"python -m ftcomm: unknown command {args[0]!r}", file=sys.stderr)
        print(USAGE, end="", file=sys.stderr)
        return 2
    from . import _bench

    return _bench.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
