"""The policy losses: GRPO's group-normalised advantages and PPO-clipped, token-level loss,
and the warm start's next-token cross-entropy.

Losses read label-aligned rows (``LabelRows``, or a CP shard's ``CPBatch``): at position
``t``, ``next_tokens[b, t]`` is the token the logits at ``t`` predict and
``next_old_logprobs[b, t]`` its behaviour log-probability (from the logits that sampled
it), meaningful where ``next_token_mask[b, t]`` (a response token).
"""

import torch
import torch.nn.functional as F

from titan_cotrain.data.batch import LabelRows, PolicyLoss

__all__ = ["group_advantages", "next_token_logprobs", "next_token_loss", "ppo_loss"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean_g) / (std_g + eps)`` within consecutive groups of ``group_size`` samples.

    ``rewards: [N]`` with ``N`` a multiple of ``group_size``; a group whose rewards are all
    equal gets zero advantages (it carries no signal).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, keepdim=True) + eps)).flatten()


def next_token_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: log-probability of ``next_tokens[:, t]`` under ``logits[:, t]``."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, next_tokens[..., None]).squeeze(-1)


def next_token_loss(logits: torch.Tensor, rows: LabelRows) -> PolicyLoss:
    """The warm start's loss: summed CE of each position's next token inside its document,
    over training targets (``logits [B, S, V]``)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), rows.next_tokens.flatten(), reduction="none")
    return PolicyLoss((ce * rows.next_token_mask.flatten()).sum(), rows.next_token_mask.sum())


def ppo_loss(clip_eps_low: float, clip_eps_high: float, kl_coef: float = 0.0, temperature: float = 1.0,
             tis_cap: float = 0.0):
    """The policy loss function for ``forward_backward``: PPO-clipped ratio times the token's
    advantage, summed over response tokens (the caller divides by the global token count:
    token-mean aggregation), plus ``kl_coef * KL(policy || reference)`` by the non-negative
    k3 estimator when on. ``temperature`` is the rollouts' sampling temperature: the
    behaviour log-probs come from ``logits / temperature``, so the ratio's numerator does
    too (greedy rollouts, temperature 0, are scored at temperature 1).

    The ratio is against the engine's behaviour log-probs ``b``; with ``tis_cap > 0``
    (truncated importance sampling) it is against the trainer's own detached log-probs
    ``l`` (one update per step: the policy the update starts from), and each token's term
    is weighted by ``min(exp(l - b), tis_cap)``, correcting for the engine sampling from a
    slightly different distribution. ``rl/engine_kl`` sums ``exp(l - b) - (l - b) - 1``, the
    k3 estimate of KL(engine || trainer) on the engine's samples (at a later update of the
    same rollouts it also holds the policy's drift)."""
    scale = 1.0 / temperature if temperature > 0 else 1.0

    def loss_fn(logits: torch.Tensor, rows: LabelRows) -> PolicyLoss:
        logp = next_token_logprobs(logits * scale, rows.next_tokens)
        mask = rows.next_token_mask.float()
        behaviour = rows.next_old_logprobs
        adv = rows.next_advantages
        trainer_minus_engine = (logp.detach() - behaviour) * mask
        engine_kl = torch.exp(trainer_minus_engine) - trainer_minus_engine - 1
        ratio = torch.exp(logp - (logp.detach() if tis_cap else behaviour))
        clipped_ratio = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
        sums = {
            "rl/clip_fraction": ((ratio != clipped_ratio).float() * mask).sum().detach(),
            "rl/ratio": (ratio * mask).sum().detach(),
            "rl/engine_kl": engine_kl.sum(),  # 0 off the response: the difference is masked
        }
        if tis_cap:
            weight = torch.exp(trainer_minus_engine)
            per_token = per_token * weight.clamp(max=tis_cap)
            sums["rl/tis_truncated"] = ((weight > tis_cap).float() * mask).sum()
        if kl_coef > 0:
            delta = rows.next_ref_logprobs - logp
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + kl_coef * kl
            sums["rl/kl_ref"] = (kl * mask).sum().detach()
        return PolicyLoss((per_token * mask).sum(), mask.sum(), sums)

    return loss_fn
