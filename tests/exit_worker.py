"""A process that returns from its script while a gloo worker thread still has to drop a finished
collective's tensor, for ``tests/test_examples.py::test_a_process_that_exits_right_after_a_collective_exits_cleanly``.

Run with torchrun on 2 ranks; argv[1] is a 3-byte file of zeros the ranks signal through (a
shared mapping: rank 0 reads it without letting go of the GIL).

- Rank 0 starts an all-reduce and drops both the handle and the tensor, so gloo's worker thread
  holds the only reference to the work, and the tensor's Python object is now owned by C++.
- It then keeps the GIL (a busy loop under a long switch interval), tells rank 1 to join the
  all-reduce (byte 2), waits until rank 1's has returned (byte 0), gives its own worker time to
  finish too, marks that it saw all this (byte 1), and returns from the script.
- The worker, done with the all-reduce, needs the GIL to free that Python object and gets it only
  when the main thread lets go: in shardwrap's exit hook, or else once the interpreter is
  finalizing, which aborts the process (design/notes/failure-modes.md, "An abort at exit").
"""

import mmap
import sys
import time

import torch
import torch.distributed as dist

import shardwrap  # noqa: F401  (registers the exit hook under test)

RANK1_DONE, RANK0_SAW_IT, RANK1_MAY_START = 0, 1, 2

dist.init_process_group("gloo")
with open(sys.argv[1], "r+b") as f:
    flags = mmap.mmap(f.fileno(), 3)
dist.barrier()
if dist.get_rank() == 0:
    tensor = torch.ones(1024)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor, work
    sys.setswitchinterval(1000.0)  # from here on this thread keeps the GIL
    flags[RANK1_MAY_START] = 1
    give_up = time.monotonic() + 60.0
    while flags[RANK1_DONE] == 0 and time.monotonic() < give_up:
        pass
    settle = time.monotonic() + 0.3  # rank 0's worker receives the last bytes and asks for the GIL
    while time.monotonic() < settle:
        pass
    flags[RANK0_SAW_IT] = flags[RANK1_DONE]
else:
    while flags[RANK1_MAY_START] == 0:
        time.sleep(0.001)
    dist.all_reduce(torch.ones(1024))
    flags[RANK1_DONE] = 1
    time.sleep(1.0)  # still here when rank 0 exits
