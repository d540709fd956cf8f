"""Nothing lost to a NaN: detect a non-finite update on every rank alike, skip it, and never
save weights that are not finite, or that are finite but give a non-finite forward.

An update is *non-finite* for the policy when its loss or its gradient norm is NaN or inf,
and likewise for the draft; the two are judged separately (a draft that diverges does not
stop the policy from training, and the reverse). The verdict is maxed over every rank, so
all ranks skip the same optimizer steps and stay in lockstep: one small all-reduce per
update, read on the host together with the update's metrics.

Finite weights can still be unusable: one update at a huge learning rate leaves every weight
finite and every activation inf. So before a checkpoint or an export the trainer also runs
``forward_is_finite``: one forward of a short probe through the policy and the draft, the
first thing a user of the export would do.
"""

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from titan_cotrain.components.shards import local_shard

__all__ = ["NonfiniteStop", "NonfiniteWeights", "SaveGuard", "all_finite", "count_skipped_updates",
           "forward_is_finite", "nonfinite_flags"]


class NonfiniteStop(RuntimeError):
    """The job stops: too many consecutive steps with a skipped update (every rank raises it)."""


class NonfiniteWeights(NonfiniteStop):
    """Raised instead of writing a checkpoint or an export with non-finite weights, or weights
    whose forward on a probe is not finite."""


def nonfinite_flags(metrics: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``{"nonfinite/policy": 0. | 1., "nonfinite/draft": 0. | 1.}`` (device scalars, the same on
    every rank): 1 where ``loss/<part>`` or ``grad_norm/<part>`` in ``metrics`` is not finite on
    any rank. A part a rank has no metric of (no draft, or a PP rank without it) counts as finite there."""
    flags = []
    for part in ("policy", "draft"):
        values = [metrics[key] for key in (f"loss/{part}", f"grad_norm/{part}") if key in metrics]
        bad = torch.zeros((), dtype=torch.bool, device=device)
        for value in values:
            bad = bad | ~torch.isfinite(torch.as_tensor(value, device=device))
        flags.append(bad)
    stacked = torch.stack(flags).float()
    if dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return {"nonfinite/policy": stacked[0], "nonfinite/draft": stacked[1]}


@torch.no_grad()
def all_finite(modules: Iterable[nn.Module | None], device: torch.device, *, collective: bool = True) -> bool:
    """Whether every parameter and buffer of ``modules`` is finite, on every rank when
    ``collective`` (FSDP shards and PP stages: each rank checks what it holds). One host
    read; ``None`` entries are skipped."""
    ok = torch.ones((), dtype=torch.float32, device=device)
    for module in modules:
        if module is None:
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            local = local_shard(tensor)
            if local.is_floating_point() and local.numel():
                ok = torch.minimum(ok, torch.isfinite(local).all().float())
    return _on_every_rank(ok, collective)


@torch.no_grad()
def forward_is_finite(policy: nn.Module, draft: nn.Module | None, tokens: torch.Tensor, *,
                      collective: bool = True) -> bool:
    """Whether one forward of ``tokens: int64 [1, S]`` (one document, on the models' device)
    through ``policy`` (a ``Transformer``) gives finite logits and, with a ``draft``, so does
    the draft's first TTT pass over the policy's taps of it. The models are whole copies, or a
    tensor-parallel policy copy whose ranks all call this; the verdict is min-reduced over
    every rank when ``collective``, so all stop alike. One host read."""
    s = tokens.shape[1]
    out = policy(tokens, return_taps=draft is not None)
    ok = torch.isfinite(out if draft is None else out.logits).all()
    if draft is not None and hasattr(draft, "forward_pass"):  # EAGLE-3
        positions = torch.arange(s, device=tokens.device)
        select = torch.ones(1, s, dtype=torch.bool, device=tokens.device)
        (logits,) = draft(torch.cat(out.taps, -1)[0], out.embeddings[0], tokens[0], positions, [0, s], select)
        ok &= torch.isfinite(logits).all()
    elif draft is not None:  # a block drafter: the block at the last position
        positions = torch.arange(s, device=tokens.device)
        last = positions[-1:]
        hidden = draft(torch.cat(out.taps, -1)[0], positions, out.embeddings[0, -1:], last, last.new_zeros(1), last)
        ok &= torch.isfinite(draft.head_module_logits(hidden, policy.lm_head)).all()
    return _on_every_rank(ok.float(), collective)


def _on_every_rank(ok: torch.Tensor, collective: bool) -> bool:
    """A rank's verdict ``ok`` (fp32 scalar, 1 or 0), min-reduced over every rank when
    ``collective``: the one host read of a check."""
    if collective and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def count_skipped_updates(state, step: int, metrics: dict[str, float], limit: int, last_step: bool,
                          announce: Callable[[str], None]) -> None:
    """Count consecutive steps with a skipped update in ``state.nonfinite_steps`` (a
    ``TrainerState``), and ``announce`` the skip when step ``step`` had one. Raises
    ``NonfiniteStop`` at ``limit`` such steps in a row, or at once when the job's last step had
    one: nothing is checkpointed or exported then (every rank alike: the verdicts are the same
    on every rank)."""
    skipped = [part for part in ("policy", "draft") if metrics.get(f"nonfinite/{part}", 0.0) > 0]
    if not skipped:
        state.nonfinite_steps = 0
        return
    state.nonfinite_steps += 1
    announce(f"step {step}: non-finite loss or gradient norm of the {' and the '.join(skipped)}: update "
             f"skipped ({state.nonfinite_steps} in a row, the job stops at {limit})")
    if state.nonfinite_steps >= limit:
        raise NonfiniteStop(
            f"at step {step}: {limit} consecutive steps had a non-finite loss or gradient norm "
            f"(training.max_nonfinite_steps = {limit}); the weights are those of the last finite update, the "
            "last checkpoint is before it. Lower the learning rates (optimizer.lr, draft.lr, task.sft_lr, draft.sft_lr) or the "
            "gradient clips (training.max_norm, draft.grad_clip).")
    if last_step:
        raise NonfiniteStop(
            f"at step {step}, the job's last: the update of the {' and the '.join(skipped)} was skipped "
            f"(non-finite loss or gradient norm, {state.nonfinite_steps} step(s) in a row), so the weights "
            "are not trained to the end: nothing is exported and this step is not checkpointed. Resume from an "
            "earlier checkpoint, if there is one, with lower learning rates (optimizer.lr, draft.lr) or gradient "
            "clips (training.max_norm, draft.grad_clip).")


class SaveGuard:
    """Refuses to write weights (a checkpoint, the export) that are not finite, or whose forward
    on a probe is not. ``probe()``: the probe's token ids (read when first needed);
    ``active``: False where device values are unknown (the simulator: nothing is checked)."""

    def __init__(self, device: torch.device, probe: Callable[[], list[int]], active: bool = True) -> None:
        self.device, self._probe, self.active = device, probe, active

    def weights(self, what: str, *modules: nn.Module | None, collective: bool = True) -> None:
        """Every parameter and buffer of ``modules`` finite (``all_finite``), or raise."""
        if self.active and not all_finite(modules, self.device, collective=collective):
            raise NonfiniteWeights(f"{what} is not written: the weights are not finite")

    def probe(self, what: str, policy: nn.Module, draft: nn.Module | None) -> None:
        """One forward of the probe through the whole copies ``policy`` and ``draft`` finite on
        every rank (a collective; ``forward_is_finite``), or raise. The weights must be finite
        already."""
        if not self.active:
            return
        tokens = torch.tensor([self._probe()], device=self.device)
        if not forward_is_finite(policy, draft, tokens):
            models = "the policy and the draft" if draft is not None else "the policy"
            raise NonfiniteWeights(
                f"{what} is not written: the weights are finite, but a forward of {models} on a probe of "
                f"{tokens.shape[1]} tokens is not (the last updates made them unusable). Lower the learning rates "
                "(optimizer.lr, draft.lr, task.sft_lr, draft.sft_lr) or the gradient clips (training.max_norm, "
                "draft.grad_clip).")
