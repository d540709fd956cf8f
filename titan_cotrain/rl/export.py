"""The job's export: the policy as a Hugging Face folder (with the job's tokenizer files), the
draft as an EAGLE-3 folder. ``export_job`` writes ``<dump_folder>/export`` at the end of a
job, from the rollout engine's copies; ``python -m titan_cotrain.export`` writes the same
folders from a DCP checkpoint (``titan_cotrain/export.py``). Both go through
``write_export``, so the same weights give the same bytes."""

import os
import shutil
from collections.abc import Callable

import torch

from titan_cotrain.models.draft import Draft
from titan_cotrain.models.block_draft import BlockDrafter
from titan_cotrain.models.dflash import save_dflash
from titan_cotrain.models.eagle3 import ENGINE_N_TAPS, save_eagle3
from titan_cotrain.models.hf_stream import save_hf_streamed
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.parallel.engine_tp import whole_host_state

__all__ = ["export_job", "write_export"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_export(folder: str, policy: Transformer, read_policy: Callable[[str], torch.Tensor],
                 draft: Draft | BlockDrafter | None, tokenizer_folder: str, mask_token_id: int = -1) -> str:
    """Write ``folder/policy`` (Hugging Face, plus the tokenizer files of ``tokenizer_folder``)
    and ``folder/draft`` (EAGLE-3); returns what was written ("the policy and the draft").

    ``policy`` gives the config, the dtype (its embedding's) and the tensors' names and
    shapes, and may live on the meta device; ``read_policy(name)`` gives its state-dict entry
    ``name`` whole, and is called once per tensor as the file is written, so the host holds
    one tensor of the policy at a time (``models.hf_stream``). ``draft``: whole, in the
    dtype to write; None: the policy only. A draft fusing other than 3 tap layers is not
    written (the engines load exactly 3), and that is printed. A block drafter is written as
    a DFlash folder; with ``mask_token_id`` (not -1) the policy's embedding row
    ``mask_token_id`` is written as the drafter's mask embedding, which is how SGLang embeds
    the mask token (``[draft] mask_token_id``)."""
    if isinstance(draft, BlockDrafter) and mask_token_id != -1:
        read_policy = _with_mask_row(read_policy, mask_token_id, draft.mask_embedding.detach())
    save_hf_streamed(policy, os.path.join(folder, "policy"), read_policy)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_folder, name)):
            shutil.copy(os.path.join(tokenizer_folder, name), os.path.join(folder, "policy", name))
    if draft is None:
        return "the policy"
    if isinstance(draft, BlockDrafter):
        save_dflash(draft, os.path.join(folder, "draft"), n_target_layers=policy.args.n_layers,
                    mask_token_id=None if mask_token_id == -1 else mask_token_id)
        return "the policy and the block drafter"
    if len(policy.tap_layers) != ENGINE_N_TAPS:
        print(f"the draft fuses {len(policy.tap_layers)} tap layers; vLLM and SGLang load EAGLE-3 drafts "
              f"of exactly {ENGINE_N_TAPS}, so it is not exported", flush=True)
        return "the policy"
    save_eagle3(draft, os.path.join(folder, "draft"), policy.tap_layers,
                target_max_position_embeddings=policy.args.max_seq_len)
    return "the policy and the draft"


def _with_mask_row(read_policy: Callable[[str], torch.Tensor], row: int,
                   mask_embedding: torch.Tensor) -> Callable[[str], torch.Tensor]:
    """``read_policy`` with row ``row`` of the embedding replaced by ``mask_embedding``."""

    def read(name: str) -> torch.Tensor:
        tensor = read_policy(name)
        if name != "embed_tokens.weight":
            return tensor
        tensor = tensor.clone()
        tensor[row] = mask_embedding.to(tensor)
        return tensor

    return read


def export_job(trainer) -> None:
    """Every rank gathers the whole models into the rollout engine's copies (FSDP shards, PP
    stages; a tensor-parallel engine's slices are gathered once more, one tensor at a time),
    the logging rank writes them, in the engine's dtype. Weights that are not finite, or
    whose forward on a probe is not, are not written."""
    trainer.refresh_engine()
    # Every rank holds the same whole copies (or, tensor-parallel, its slices: then all
    # ranks vote): each checks its own, so all stop alike.
    tp = trainer.engine.tensor_parallel > 1
    trainer.guard.weights("the export", trainer.engine.policy, trainer.engine.draft, collective=tp)
    trainer.guard.probe("the export", trainer.engine.policy, trainer.engine.draft)
    policy, draft = trainer.engine.policy, trainer.engine.draft
    state = whole_host_state(policy, keep=trainer.rank == trainer.log_rank) if tp else policy.state_dict()
    if trainer.rank != trainer.log_rank:
        return
    folder = os.path.join(trainer.config.job.dump_folder, "export")
    exported = write_export(folder, policy, state.__getitem__, draft, trainer.tokenizer_folder,
                            trainer.config.draft.mask_token_id)
    print(f"exported {exported} to {folder}", flush=True)
