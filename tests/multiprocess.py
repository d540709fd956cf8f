"""The one process-group setup helper of the test suite: run a function on N gloo ranks.

How a rank ends matters as much as how it starts. Ranks used to call
``destroy_process_group`` and then let Python finalize, and under load both could abort in
C++ there ("terminate called without an active exception"). ``destroy_process_group`` does
not always free the group: a torch module imported after ``init_process_group`` keeps it as a
default argument (``torch.distributed.nn``'s ``group=group.WORLD``, which FSDP, DCP and the
pipeline import, so ``import titan_cotrain.rl.trainer`` inside ``fn`` does). The gloo
worker and I/O threads and rank 0's TCPStore server then run until finalization's garbage
collection frees the group, while the interpreter is half torn down and the peer is
tearing down too; gloo's ``Loop::~Loop``, for one, calls ``std::terminate`` if its I/O
thread is still running. So every rank ends in three steps:

1. a barrier: no rank tears down (rank 0's store server included) while a peer is still in
   ``fn``;
2. ``destroy_process_group`` while the interpreter is fully alive;
3. ``os._exit`` after flushing stdout and stderr (``exit_process``, as the project's own
   entry points end): no finalization, so no C++ destructor in it.

A rank whose ``fn`` raised writes its traceback and exits at once with status 1, without a
barrier or a teardown that could wait on its peers; ``torch.multiprocessing`` then stops the
other ranks, so one failing rank fails the test instead of hanging it.
"""

import contextlib
import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_cotrain.parallel.process_end import exit_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, tracebacks: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    # Tiny shapes on a few cores: intra-op threads only oversubscribe the machine.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        # A file, not a pipe: a long traceback cannot block this rank's exit.
        Path(tracebacks, str(rank)).write_text(traceback.format_exc())
        exit_process(1)
    exit_process(0)


def run_on_ranks(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a module-level function (it is pickled). A failure on any rank fails
    the calling test with the traceback of every rank that raised.
    """
    with tempfile.TemporaryDirectory() as tracebacks:
        try:
            mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, tracebacks), nprocs=world_size,
                               start_method="spawn")
        except Exception as e:
            details = [f"--- rank {path.name} ---\n{path.read_text()}"
                       for path in sorted(Path(tracebacks).iterdir(), key=lambda p: int(p.name))]
            raise AssertionError("a rank failed:\n" + "\n".join(details)) from e


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for tiny kernels: on a few shared cores OpenMP threads only
    contend (also applied on every rank ``run_on_ranks`` starts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
