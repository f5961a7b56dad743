"""Inject a failed allreduce into a torchft ``DistributedDataParallel`` job.

ftcomm's ``FakeProcessGroupWrapper`` fails the next op with the error you
give it. Under torchft's DDP, inject with ``wait_raises=False``: the op's
future fails and its ``wait()`` does not raise, which is how torchft's
Manager takes an error. The step's ``backward()`` completes, the Manager
holds the error, ``should_commit()`` is False, and the next step commits.

(With the default ``wait_raises=True``, as a real failure does, torchft
0.2.0's DDP comm hook asserts (``assert fut._fut``, torchft/ddp.py) and
``backward()`` raises: torchft's ``_ManagedWork`` builds its future chain
only after ``wait()`` returned. That is torchft's, whatever the process
group; this script shows it with ``--wait-raises``.)

One replica, torchft's lighthouse in this process, all on loopback. Needs
torchft (``pip install 'ftcomm[torchft]'``)::

    python examples/torchft_ddp_faults.py [--wait-raises]
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft._torchft import LighthouseServer
from torchft.checkpointing.pg_transport import PGTransport
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager

from ftcomm.c10d import FakeProcessGroupWrapper, ProcessGroupGloo

TIMEOUT = timedelta(seconds=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--wait-raises",
        action="store_true",
        help="inject as a real failure does (torchft 0.2.0's DDP then asserts)",
    )
    args = parser.parse_args()

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=50)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fake = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    manager = Manager(
        pg=fake,
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id="solo",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        checkpoint_transport=PGTransport(fake, timeout=TIMEOUT, device=torch.device("cpu")),
    )
    model = DistributedDataParallel(manager, torch.nn.Linear(3, 2))
    outcomes = []
    try:
        for step in range(3):
            manager.start_quorum()
            model.zero_grad()
            if step == 1:
                manager.wait_quorum()  # a configure drops an error injected before it
                fake.report_future_error(
                    RuntimeError("injected at step 1"), wait_raises=args.wait_raises
                )
            model(torch.ones(4, 3)).sum().backward()
            error = manager.errored()
            committed = manager.should_commit()
            why = str(error.original_exception).splitlines()[0] if error else None
            print(f"step {step}: committed={committed} error={why}")
            outcomes.append((committed, error is not None))
    finally:
        manager.shutdown(wait=False)
        fake.shutdown()
        lighthouse.shutdown()
    ok = outcomes == [(True, False), (False, True), (True, False)]
    print("ok: the injected step was not committed, the others were" if ok else "PROBLEM")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
