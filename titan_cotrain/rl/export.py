"""The job's final export: the policy as a Hugging Face folder (with the job's tokenizer files),
the draft as an EAGLE-3 folder, in ``<dump_folder>/export``."""

import os
import shutil

from titan_cotrain.models.eagle3 import save_eagle3
from titan_cotrain.models.hf import save_hf
from titan_cotrain.parallel.engine_tp import whole_host_state

__all__ = ["export_job"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def export_job(trainer) -> None:
    """Every rank gathers the whole models into the rollout engine's copies (FSDP shards, PP
    stages; a tensor-parallel engine's slices are gathered once more, one tensor at a time),
    the logging rank writes them. Weights that are not finite, or whose forward on a probe is
    not, are not written."""
    trainer.refresh_engine()
    # Every rank holds the same whole copies (or, tensor-parallel, its slices: then all
    # ranks vote): each checks its own, so all stop alike.
    tp = trainer.engine.tensor_parallel > 1
    trainer.guard.weights("the export", trainer.engine.policy, trainer.engine.draft, collective=tp)
    trainer.guard.probe("the export", trainer.engine.policy, trainer.engine.draft)
    policy, draft = trainer.engine.policy, trainer.engine.draft
    state = whole_host_state(policy, keep=trainer.rank == trainer.log_rank) if tp else None
    if trainer.rank != trainer.log_rank:
        return
    folder = os.path.join(trainer.config.job.dump_folder, "export")
    save_hf(policy, os.path.join(folder, "policy"), state=state)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(trainer.tokenizer_folder, name)):
            shutil.copy(os.path.join(trainer.tokenizer_folder, name), os.path.join(folder, "policy", name))
    exported = "the policy"
    if draft is not None and len(policy.tap_layers) == 3:
        save_eagle3(draft, os.path.join(folder, "draft"), policy.tap_layers,
                    target_max_position_embeddings=policy.args.max_seq_len)
        exported += " and the draft"
    elif draft is not None:
        print(f"the draft fuses {len(policy.tap_layers)} tap layers; vLLM and SGLang load EAGLE-3 drafts "
              "of exactly 3, so it is not exported", flush=True)
    print(f"exported {exported} to {folder}", flush=True)
