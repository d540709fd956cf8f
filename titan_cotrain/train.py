"""The main job: ``torchrun ... -m titan_cotrain.train --job.config_file F [--section.key value]``.

Warm start (``task.sft_steps``), then RL with the EAGLE-3 draft co-trained in the policy's
own forward; see ``titan_cotrain.rl.trainer``. With ``--simulate.enable`` the same job runs
under the scale simulator instead (``titan_cotrain.simulate.run``): one process, no GPU.
"""

import os
import sys

import torch
import torch.distributed as dist

from titan_cotrain.components import titan
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.data.prompts import PromptDatasetError
from titan_cotrain.parallel.process_end import exit_process, leave_process_group
from titan_cotrain.rl.nonfinite import NonfiniteStop
from titan_cotrain.rl.rewards import RewardError
from titan_cotrain.rl.trainer import Trainer


def init_distributed(config) -> int:
    """The job's process group when launched by torchrun (torchtitan's init); the world size."""
    if "WORLD_SIZE" not in os.environ:
        return 1
    return titan.init_distributed(config.comm)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        config = load_job_config(args)  # a simulated job validates against its own world
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if config.simulate.enable:
        return _simulate(config, args)
    if config.simulate.check_at_start and _simulate(config, args, before_training=True):
        return 1
    if config.debug.deterministic:  # torchtitan's key: torch's deterministic algorithms only
        torch.use_deterministic_algorithms(True, warn_only=config.debug.deterministic_warn_only)
    world_size = init_distributed(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    succeeded = False
    try:
        Trainer(config, world_size, rank).run()
        succeeded = True
    except NonfiniteStop as e:  # every rank stops alike; one message, no traceback
        if rank == 0:
            print(f"training stopped: {e}", file=sys.stderr, flush=True)
        return 1
    except PromptDatasetError as e:
        print(f"dataset error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:  # the message holds the record and the reward's own traceback
        print(f"reward error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        leave_process_group(succeeded=succeeded)
    return 0


def _simulate(config, args: list[str], before_training: bool = False) -> int:
    """``--simulate.enable``: the scale simulator instead of training (one process, every
    simulated rank in turn); 1 when a rank does not fit or a collective saw a host tensor.
    ``before_training`` (``[simulate] check_at_start``): every process runs the same check
    (the same ranks, so all decide alike) before the job's process group exists, the report
    going to the dump folder."""
    from titan_cotrain.config.loader import config_file_of
    from titan_cotrain.simulate.run import SimulationFailed, simulate

    output = os.path.join(config.job.dump_folder, "scale_check.json") if before_training else None
    try:
        simulate(config, str(config_file_of(args)), output=output,
                 args=(args, None if before_training else "config"))
    except SimulationFailed as e:
        print(f"simulate: does not fit: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
