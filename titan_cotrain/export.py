"""Export a DCP checkpoint of any layout as the folders a job's end writes.

``python -m titan_cotrain.export --checkpoint DIR [--step N] --out DIR [--dtype D]
[--job.config_file F --section.key value ...]``

``--checkpoint``: a ``step-N`` folder, or a checkpoint folder (``<dump_folder>/checkpoint``:
its latest step, or ``--step N``). Writes ``<out>/policy`` (a Hugging Face folder with the
job's tokenizer files) and ``<out>/draft`` (an EAGLE-3 folder) through the writer of
``Trainer.export()`` (``rl.export.write_export``): for the checkpoint of a job's last step, the
bytes of that job's ``<dump_folder>/export``, whatever layout (FSDP, CP, PP, EP) saved it.
The job's arguments give the models' shapes and the tokenizer (they must be the job's);
``--dtype``: of the weights written, by default the rollout engine's on this host, which is
what the job's end writes (``float32`` on a CPU, ``bfloat16`` with a GPU: a GPU job's
checkpoint exported on a CPU host needs ``--dtype bfloat16`` for its job's bytes). It prints
``exported the policy and the draft of step N (<step folder>) to <out> in float32``.

One process, no process group: DCP reads each tensor whole, gathered from every rank's
shards (``no_dist``), one at a time as the policy's file is written; only the models'
tensors are read (no optimizer state). Beyond the interpreter the host holds the draft (one
layer) whole and one tensor of the policy (twice while DCP assembles it):
``scripts/export_memory.py`` measures it. A checkpoint without the draft's tensors (a
model-only save: ``[checkpoint] last_save_model_only``) exports the policy alone and says so.
Weights are not checked for finiteness here: the job checked them before saving the
checkpoint. Launched by ``torchrun``, it must be with one rank.
"""

import argparse
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titan_cotrain.components import titan
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.eval import ONE_PROCESS
from titan_cotrain.parallel.process_end import exit_process

__all__ = ["CheckpointTensors", "ExportError", "checkpoint_step", "export_checkpoint", "main"]

DRAFT_PREFIX = "draft."  # the trainer's checkpointer saves the draft's Stateful under "draft"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The job's layout, whatever it was, validated as one process: nothing here is parallel.
ONE_RANK = ONE_PROCESS  # every parallel degree 1 (expert and the engine's tensor parallelism included)


class ExportError(ValueError):
    """Nothing to export: no checkpoint, no such step, or one that does not hold the config's models."""


def checkpoint_step(path: str, step: int | None = None) -> tuple[str, int]:
    """``(the step-N folder, N)`` to export: ``path`` itself when it is a ``step-N`` folder,
    else ``path/step-<step>``, by default its latest. A step counts once DCP has written its
    ``.metadata`` (the last file of a save)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ExportError(f"no checkpoint: {path} is not a folder")
    own = re.fullmatch(r"step-(\d+)", os.path.basename(path))
    if own:
        if step is not None and step != int(own.group(1)):
            raise ExportError(f"--step {step}, but {path} is the checkpoint of step {own.group(1)}")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ExportError(f"no checkpoint: {path} has no .metadata (a save that did not finish?)")
        return path, int(own.group(1))
    steps = sorted(int(m.group(1)) for name in os.listdir(path) if (m := re.fullmatch(r"step-(\d+)", name))
                   and os.path.isfile(os.path.join(path, name, ".metadata")))
    if not steps:
        raise ExportError(f"no checkpoint in {path}: no step-N folder with a .metadata file (a job saves them in "
                          "<dump_folder>/checkpoint)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"no checkpoint of step {step} in {path}; its steps: {', '.join(map(str, steps))}")
    return os.path.join(path, f"step-{step}"), step


class _MetadataOnce(FileSystemReader):
    """DCP's file reader with the checkpoint's ``.metadata`` unpickled once, not at each of
    the export's one-tensor loads (it describes every optimizer state too)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class CheckpointTensors(Mapping):
    """The tensors of one DCP checkpoint step whose keys start with ``prefix`` (named without
    it), each read whole, in its saved dtype, on the host, when looked up: the saved shards
    of every rank are read and assembled by DCP in this one process (``no_dist``)."""

    def __init__(self, folder: str, prefix: str = "") -> None:
        self._reader = _MetadataOnce(folder)
        self._prefix = prefix
        self._saved = {key.removeprefix(prefix): saved
                       for key, saved in self._reader.read_metadata().state_dict_metadata.items()
                       if key.startswith(prefix) and isinstance(saved, TensorStorageMetadata)}

    def shape(self, name: str) -> torch.Size:
        return self._saved[name].size

    def __getitem__(self, name: str) -> torch.Tensor:
        saved = self._saved[name]
        whole = torch.empty(saved.size, dtype=saved.properties.dtype)
        with warnings.catch_warnings():  # that it loads in one process is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({self._prefix + name: whole}, storage_reader=self._reader, no_dist=True)
        return whole

    def __iter__(self) -> Iterator[str]:
        return iter(self._saved)

    def __len__(self) -> int:
        return len(self._saved)


def _mismatches(expected: Mapping[str, torch.Size], saved: CheckpointTensors, optional: set[str] = frozenset(),
                prefix: str = "") -> list[str]:
    """How ``saved`` differs from a model's state dict ``expected`` (name -> shape): tensors
    it lacks (but ``optional`` ones), holds in another shape, or holds beside them under the
    same top-level modules (a deeper model's ``layers.8.*``; other states are saved under
    keys of their own)."""
    problems = []
    for name, shape in expected.items():
        if name not in saved:
            if name not in optional:
                problems.append(f"{prefix}{name} missing")
        elif saved.shape(name) != shape:
            problems.append(f"{prefix}{name} is {list(saved.shape(name))} in the checkpoint, "
                            f"{list(shape)} in the config")
    modules = {name.split(".")[0] for name in expected}
    problems += [f"{prefix}{name} not in the config's model" for name in saved
                 if name.split(".")[0] in modules and name not in expected]
    return problems


def export_checkpoint(config, folder: str, out: str, dtype: torch.dtype) -> str:
    """Write the policy and the draft of the DCP checkpoint step ``folder`` to ``out``
    (``rl.export.write_export``), in ``dtype``, shaped as ``config`` builds them; returns what
    was written."""
    from titan_cotrain.engine.engine_copy import copy_state, empty_copy
    from titan_cotrain.models.build import build_draft, build_target
    from titan_cotrain.engine.build import engine_class
    from titan_cotrain.rl.export import write_export
    from titan_cotrain.rl.trainer_setup import tokenizer_folder

    policy = build_target(config, device="meta").to(dtype)  # shapes, names and config only
    saved = CheckpointTensors(folder)
    tied_head = {"lm_head.weight"} if policy.args.tie_embeddings else set()  # the embedding, not written
    problems = _mismatches({name: t.shape for name, t in policy.state_dict().items()}, saved, tied_head)
    if problems:
        raise ExportError(f"{folder} does not hold the config's policy ({_listed(problems)}): pass the job's "
                          "--job.config_file and the overrides it ran with")
    saved_draft = CheckpointTensors(folder, DRAFT_PREFIX)
    draft = None
    if not config.draft.enable:
        if saved_draft:
            print("note: [draft] enable = false in the config: the checkpoint's draft is not exported", flush=True)
    elif not saved_draft:
        print(f"note: {folder} holds no draft (a model-only save, [checkpoint] last_save_model_only?): "
              "exporting the policy only", flush=True)
    else:
        # A reduced vocabulary's maps are read with the rest: any counts give their shapes.
        counts = torch.ones(policy.args.vocab_size, dtype=torch.int64)
        shell = build_draft(config, policy, token_counts=counts, device="meta")
        problems = _mismatches({name: t.shape for name, t in shell.state_dict().items()}, saved_draft,
                               prefix=DRAFT_PREFIX)
        if problems:
            raise ExportError(f"{folder} does not hold the config's draft ({_listed(problems)}): pass the "
                              "job's --job.config_file and the overrides it ran with")
        # Built as the rollout engine builds its copy, filled one tensor at a time.
        draft = empty_copy(lambda: engine_class(shell)._draft_shell(shell), torch.device("cpu"), dtype)
        copy_state(draft, saved_draft)
    return write_export(out, policy, saved.__getitem__, draft, tokenizer_folder(config), config.draft.mask_token_id)


def _listed(problems: list[str], most: int = 6) -> str:
    more = f"; and {len(problems) - most} more" if len(problems) > most else ""
    return "; ".join(problems[:most]) + more


def _arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The export's own flags, and the job's arguments with one process as overrides."""
    parser = argparse.ArgumentParser(prog="python -m titan_cotrain.export", allow_abbrev=False,
                                     epilog="Other arguments are the job's: --job.config_file F --section.key value")
    parser.add_argument("--checkpoint", required=True, help="a DCP step-N folder or a checkpoint folder")
    parser.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    parser.add_argument("--out", required=True, help="the folder to write policy/ and draft/ in")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="of the weights written (default: the rollout engine's on this host, as the job's "
                             "end writes: float32 on a CPU, bfloat16 with a GPU)")
    args, job = parser.parse_known_args(argv)
    return args, [*job, *ONE_RANK]


def main(argv: list[str] | None = None) -> int:
    args, job = _arguments(sys.argv[1:] if argv is None else argv)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        print("export error: the export runs on one process (torchrun --nproc_per_node 1, or plain python)",
              file=sys.stderr)
        return 2
    try:
        config = load_job_config(job, world_size=1)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # The rollout engine's dtype (RolloutEngine.from_models), which the job's end writes.
    dtype = DTYPES[args.dtype] if args.dtype else torch.float32 if titan.device_type() == "cpu" else torch.bfloat16
    try:
        folder, step = checkpoint_step(args.checkpoint, args.step)
        exported = export_checkpoint(config, folder, args.out, dtype)
    except ValueError as e:  # ExportError, and a config the models cannot be built from
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"exported {exported} of step {step} ({folder}) to {os.path.abspath(args.out)} in "
          f"{str(dtype).removeprefix('torch.')}", flush=True)
    return 0


if __name__ == "__main__":
    exit_process(main())
