"""``python -m ftcomm <command>``: the project's command-line tools.

Commands:
    run     start a job's members, restart the ones that die, never stop the others
    store   host a store that ranks configure() against (loopback by default)
    doctor  what this machine has: torch, backends, which abort for real, ...
    bench   time ftcomm's collectives against raw torch.distributed Gloo
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module with a main(argv) -> int, one line of help)
COMMANDS = {
    "run": ("ftcomm._launch", "start N members of a job; restart only the dead (Membership)"),
    "store": ("ftcomm._server", "host a store for configure() (loopback unless --host)"),
    "doctor": ("ftcomm._doctor", "check this machine: torch, backends, aborts, /dev/shm, a store"),
    "bench": ("ftcomm._bench", "time ftcomm's collectives against raw torch.distributed Gloo"),
}

USAGE = (
    "usage: python -m ftcomm <command> [options]\n\ncommands:\n"
    + "".join(f"  {name:<7} {text}\n" for name, (_, text) in COMMANDS.items())
    + "\n(python -m ftcomm <command> --help for its options)\n"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; no command or an unknown one prints usage and returns 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not args or args[0] not in COMMANDS:
        if args:
            print(f"python -m ftcomm: unknown command {args[0]!r}", file=sys.stderr)
        print(USAGE, end="", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    code: int = module.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
