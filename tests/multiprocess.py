"""The one process-group setup helper of the test suite: run a function on N gloo ranks."""

import contextlib
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    # Tiny shapes on a few cores: intra-op threads only oversubscribe the machine.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a module-level function (it is pickled). A failure on any rank fails
    the calling test with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, errors), nprocs=world_size,
                           start_method="spawn")
    except Exception as e:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
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
