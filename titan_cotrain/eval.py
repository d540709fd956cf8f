"""Held-out evaluation of a trained policy and its draft, at the job's rollout settings.

``python -m titan_cotrain.eval --job.config_file F [--section.key value] [--checkpoint DIR |
--hf_policy DIR --eagle3_draft DIR] [--path FILE] [--samples N] [--pass_k 1 4 8]``, on one
process, or on N under ``torchrun --nproc_per_node N`` (the prompts split over the
data-parallel ranks, as the job's own evaluations are: ``rl.evaluation``).

The models come from the job's latest DCP checkpoint under its dump folder, from
``--checkpoint DIR`` (a ``step-N`` folder, or a checkpoint folder: its latest step; a
checkpoint of any layout loads), or from what ``Trainer.export()`` writes: a Hugging Face
policy folder and an EAGLE-3 draft folder. The prompts are ``--path FILE``'s records
(``[eval] path``: scored by ``[eval] task``, default the job's), or the job's held-out split
(``[task] eval_size`` or ``eval_fraction``), or a synthetic task's ``[eval] prompts`` draws.
Each is answered ``--samples`` times (default ``[eval] samples``, else ``rl.group_size``) by
the rollout engine, speculatively when the job's rollouts are, at ``[eval]``'s sampling
settings (default the rollouts'). Written to ``<dump_folder>/eval/eval_step<N>.json``
(``eval_hf.json`` for exported folders), with every response (``.responses.jsonl``) and a
plot (``.png``, when matplotlib, the ``bench`` extra, is installed); the keys are
``rl.evaluation``'s: ``accuracy``, ``pass_at_k``, ``reward_mean`` and the reward's parts,
``acceptance_length``, ``acceptance_rate``, ``response_len``, ...

On one process the job's parallel degrees are replaced by 1; on N, the job's layout must fit
N ranks (``--parallelism.*`` overrides), and the checkpoint reshards to it.
"""

import argparse
import os
import re
import sys

import torch.distributed as dist

from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.data.prompts import PromptDatasetError
from titan_cotrain.parallel.process_end import exit_process, leave_process_group
from titan_cotrain.rl.evaluation import EvalError, pass_at_k

__all__ = ["EvalError", "main", "pass_at_k"]

ONE_PROCESS = ("--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "-1",
               "--parallelism.context_parallel_degree", "1", "--parallelism.pipeline_parallel_degree", "1",
               "--parallelism.expert_parallel_degree", "1", "--rollout.tensor_parallel_degree", "1",
               "--metrics.no-enable_tensorboard")


def _arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The evaluation's own flags, and the job's arguments with the model source, ``[eval]``
    and (on one process) one process's layout as overrides (the command line's last value wins)."""
    parser = argparse.ArgumentParser(prog="python -m titan_cotrain.eval", allow_abbrev=False,
                                     epilog="Other arguments are the job's: --job.config_file F --section.key value")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a DCP step-N folder or a checkpoint folder (default: the job's)")
    source.add_argument("--hf_policy", help="a Hugging Face policy folder (Trainer.export's policy/)")
    parser.add_argument("--eagle3_draft", help="the EAGLE-3 draft folder that goes with --hf_policy")
    parser.add_argument("--path", help="a file of evaluation prompts ([eval] path; default: the held-out split)")
    parser.add_argument("--samples", type=int, default=0,
                        help="responses per prompt ([eval] samples; default: rl.group_size)")
    parser.add_argument("--pass_k", type=int, nargs="+", default=None,
                        help="k of pass@k ([eval] pass_k; default: 1 and samples)")
    args, job = parser.parse_known_args(argv)
    if args.eagle3_draft and not args.hf_policy:
        parser.error("--eagle3_draft goes with --hf_policy")
    job = [*job, *(ONE_PROCESS if int(os.environ.get("WORLD_SIZE", "1")) == 1 else ()), "--eval.enable"]
    job += ["--eval.path", args.path] if args.path else []
    job += ["--eval.samples", str(args.samples)] if args.samples else []
    job += ["--eval.pass_k", *map(str, args.pass_k)] if args.pass_k else []
    if args.hf_policy:
        job += ["--model.hf_path", args.hf_policy, "--checkpoint.no-enable"]
        job += ["--draft.init_path", args.eagle3_draft] if args.eagle3_draft else ["--draft.no-enable"]
    else:
        # The models and the step only: optimizer and schedule states are not needed.
        job += ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler"]
        if args.checkpoint:
            folder, step = os.path.abspath(args.checkpoint), -1
            match = re.fullmatch(r"step-(\d+)", os.path.basename(folder))
            if match:
                folder, step = os.path.dirname(folder), int(match.group(1))
            job += ["--checkpoint.folder", folder, "--checkpoint.load_step", str(step)]
    return args, job


def main(argv: list[str] | None = None) -> int:
    from titan_cotrain.rl.trainer import Trainer
    from titan_cotrain.train import init_distributed

    args, job = _arguments(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_job_config(job, world_size=world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    init_distributed(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    succeeded = False
    try:
        trainer = Trainer(config, world_size=world_size, rank=rank)
        if not args.hf_policy and not trainer.checkpointer.load(step=config.checkpoint.load_step):
            raise EvalError(f"no checkpoint in {trainer.checkpointer.folder}")
        trainer.refresh_engine()
        trainer.evaluate(trainer.state.step, stem="eval_hf" if args.hf_policy else None, log=False,
                         models=args.hf_policy)
        trainer.evaluation.close()
        trainer.scorer.close()
        succeeded = True
    except (PromptDatasetError, EvalError) as e:
        if rank == 0:
            print(f"eval error: {e}", file=sys.stderr)
        return 2
    finally:
        leave_process_group(succeeded=succeeded)
    return 0


if __name__ == "__main__":
    exit_process(main())
