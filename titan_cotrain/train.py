"""The main job: ``torchrun ... -m titan_cotrain.train --job.config_file F [--section.key value]``.

Warm start (``task.sft_steps``), then RL with the EAGLE-3 draft co-trained in the policy's
own forward; see ``titan_cotrain.rl.trainer``.
"""

import os
import sys

import torch.distributed as dist

from titan_cotrain.components import titan
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.rl.trainer import Trainer


def _init_distributed(config) -> int:
    if "WORLD_SIZE" not in os.environ:
        return 1
    titan.init_torchtitan()
    from torchtitan.distributed.utils import init_distributed

    return init_distributed(config.comm)


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_job_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    world_size = _init_distributed(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        Trainer(config, world_size, rank).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
