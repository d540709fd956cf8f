"""How a torchrun process of the project ends: its process groups destroyed while the
interpreter is fully alive, then no interpreter finalization at all.

``destroy_process_group`` does not always free a gloo group: a torch module imported after
``init_process_group`` keeps ``group.WORLD`` as a default argument (``torch.distributed.nn``,
which FSDP, DCP and the pipeline import), and the trainer's meshes are freed only by a later
garbage collection. The group's worker threads then live into finalization. A worker that
is still releasing the last collective's tensors (the export's finiteness vote, say, whose
``wait`` has already returned) needs the GIL to drop their Python objects; during
finalization that ends the thread, which aborts the process ("terminate called without an
active exception", exit -6 after a run that succeeded). So an entry point ends in three
steps:

1. on success, a barrier: no rank leaves while a peer (the logging rank exporting) is still
   working;
2. ``destroy_process_group`` (``leave_process_group``);
3. ``os._exit`` after flushing stdout, stderr and logging (``exit_process``): no
   finalization, so no C++ destructor runs in it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

__all__ = ["exit_process", "leave_process_group"]


def leave_process_group(*, succeeded: bool) -> None:
    """Destroy every process group of this process (none: nothing). ``succeeded``: every
    rank got here without an error, so they meet at a barrier first; after a failure there is
    none (a peer may be stuck in a collective, and torchrun stops it)."""
    if not dist.is_initialized():
        return
    if succeeded:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End the process with ``status`` now: output flushed, files closed by their owners
    before, and no interpreter finalization for a gloo worker thread to abort in."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
