"""A process that exits right after a collective whose tensor only gloo's worker thread still
holds, for ``tests/test_ranks.py::test_exiting_right_after_a_collective_ends_the_process_cleanly``.

Run with torchrun on 2 ranks. Rank 0 starts an all-reduce and drops both the handle and the
tensor, so the worker thread owns the tensor's Python object; it then keeps the GIL (a busy loop
under a long switch interval) while rank 1 joins the all-reduce, and returns from the script as
soon as the loop ends. The worker, done with the all-reduce, needs the GIL to drop that object,
and gets it only once the interpreter is finalizing: without shardwrap's exit hook the process
dies by SIGABRT ("terminate called without an active exception"), 6 runs out of 6.
"""

import sys
import time

import torch
import torch.distributed as dist

import shardwrap  # noqa: F401  (registers the exit hook under test)

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print("rank 0 reached the all-reduce", flush=True)  # not later: writing lets go of the GIL
    tensor = torch.ones(1024)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor, work
    sys.setswitchinterval(1000.0)
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        pass
else:
    time.sleep(0.2)
    dist.all_reduce(torch.ones(1024))
    time.sleep(1.0)  # still here when rank 0 exits
