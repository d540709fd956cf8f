"""The policy losses: GRPO's group-normalised (or RLOO's leave-one-out) advantages, the
PPO-clipped loss with a token or sequence (GSPO) ratio under four aggregations, DAPO's overlong
penalty, the entropy metric, and the warm start's next-token cross-entropy.

Losses read label-aligned rows (``LabelRows``, or a CP shard's ``CPBatch``): at position
``t``, ``next_tokens[b, t]`` is the token the logits at ``t`` predict and
``next_old_logprobs[b, t]`` its behaviour log-probability (from the logits that sampled
it), meaningful where ``next_token_mask[b, t]`` (a response token).
"""

import torch
import torch.nn.functional as F

from titan_cotrain.data.batch import LabelRows, PolicyLoss

__all__ = ["AGGREGATIONS", "entropy_sum", "group_advantages", "next_token_logprobs", "next_token_loss", "overlong_penalty",
           "ppo_loss"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *, estimator: str = "grpo",
                     normalize_std: bool = True) -> torch.Tensor:
    """Advantages within consecutive groups of ``group_size`` samples (``rewards: [N]``,
    ``N`` a multiple of ``group_size``): ``grpo`` ``r - mean_g`` divided by ``std_g + eps``
    under ``normalize_std`` (GRPO; Dr. GRPO leaves it off); ``rloo`` the leave-one-out
    baseline ``r_i - mean_{j != i} r_j`` (never std-normalised). A group whose rewards are all
    equal gets zero advantages (it carries no signal)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("the leave-one-out baseline needs groups of 2 or more")
        # r_i - (sum - r_i) / (G - 1) = (G r_i - sum) / (G - 1) = G / (G - 1) x (r_i - mean)
        return (centred * (group_size / (group_size - 1))).flatten()
    if estimator != "grpo":
        raise ValueError(f"unknown advantage estimator {estimator!r} (grpo, rloo)")
    if not normalize_std:
        return centred.flatten()
    return (centred / (groups.std(dim=1, keepdim=True) + eps)).flatten()


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong penalty of a response of ``length`` tokens: 0 up to ``L - B``
    tokens, ``((L - B) - length) / B`` beyond (down to -1 at ``L``); ``L = max_new_tokens``,
    ``B = buffer``."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer {buffer} must be in [1, max_new_tokens = {max_new_tokens}]")
    free = max_new_tokens - buffer
    return 0.0 if length <= free else (free - length) / buffer


def next_token_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: log-probability of ``next_tokens[:, t]`` under ``logits[:, t]``."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, next_tokens[..., None]).squeeze(-1)


@torch.no_grad()
def entropy_sum(log_probs: torch.Tensor, mask: torch.Tensor, rows_at_once: int = 256) -> torch.Tensor:
    """``sum_t mask_t H_t``, ``H_t = -sum_v p_tv log p_tv`` the entropy of position ``t``'s
    distribution (``log_probs [1, T, V]``, normalised), ``rows_at_once`` positions at a time
    so that its temporaries stay ``[rows_at_once, V]``; a metric, never differentiated."""
    flat, weights = log_probs.detach().flatten(0, -2), mask.flatten().float()
    total = flat.new_zeros(())
    for start in range(0, flat.shape[0], rows_at_once):
        part = flat[start:start + rows_at_once]
        total -= (part.exp() * part).sum(-1) @ weights[start:start + rows_at_once]
    return total


def next_token_loss(logits: torch.Tensor, rows: LabelRows) -> PolicyLoss:
    """The warm start's loss: summed CE of each position's next token inside its document,
    over training targets (``logits [B, S, V]``)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), rows.next_tokens.flatten(), reduction="none")
    return PolicyLoss((ce * rows.next_token_mask.flatten()).sum(), rows.next_token_mask.sum())


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def ppo_loss(clip_eps_low: float, clip_eps_high: float, kl_coef: float = 0.0, temperature: float = 1.0,
             tis_cap: float = 0.0, *, aggregation: str = "token_mean", ratio_level: str = "token",
             max_new_tokens: int = 1):
    """The policy loss function for ``forward_backward``: PPO-clipped ratio times the token's
    advantage, plus ``kl_coef * KL(policy || reference)`` by the non-negative k3 estimator
    when on. ``temperature`` is the rollouts' sampling temperature: the behaviour log-probs
    come from ``logits / temperature``, so the ratio's numerator does too (greedy rollouts,
    temperature 0, are scored at temperature 1).

    ``aggregation`` says how the token terms ``l_it`` of the update's N responses become the
    loss; every mode is a sum over tokens divided by a sum over tokens, so it is exact under
    any microbatch, CP and PP split (the caller divides the global ``loss_sum`` by the global
    ``norm``): ``token_mean`` sum l / sum |o_i| (``norm`` None: the token count);
    ``seq_mean_token_mean`` sum l / |o_i| over N; ``seq_mean_token_sum`` sum l over N;
    ``seq_mean_token_sum_norm`` sum l over N x ``max_new_tokens``. N is counted as the sum of
    ``1 / |o_i|`` over response tokens (``rows.next_inv_lens``).

    ``ratio_level = "sequence"`` (GSPO): each token's ratio is ``sg(s_i) pi / sg(pi)``, whose
    value is its response's ``s_i = exp(mean_t (log pi - log pi_old))`` (``rows.
    next_seq_logratios``, computed before the update) and whose gradient is ``s_i`` times the
    token's score; clipped to ``[1 - clip_eps_low, 1 + clip_eps_high]`` and averaged over the
    response's tokens (``seq_mean_token_mean``), it is GSPO's ``min(s_i A_i, clip(s_i) A_i)``.

    The ratio is against the engine's behaviour log-probs ``b``; with ``tis_cap > 0``
    (truncated importance sampling) it is against the trainer's own detached log-probs
    ``l`` (one update per step: the policy the update starts from), and each token's term
    is weighted by ``min(exp(l - b), tis_cap)``, correcting for the engine sampling from a
    slightly different distribution. ``rl/engine_kl`` sums ``exp(l - b) - (l - b) - 1``, the
    k3 estimate of KL(engine || trainer) on the engine's samples (at a later update of the
    same rollouts it also holds the policy's drift); ``rl/entropy`` the policy's entropy at
    each response token (at the sampling temperature)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r} ({', '.join(AGGREGATIONS)})")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown ratio level {ratio_level!r} (token, sequence)")
    if ratio_level == "sequence" and (aggregation != "seq_mean_token_mean" or tis_cap):
        raise ValueError("the sequence ratio (GSPO) averages each response over its tokens: it needs "
                         "aggregation seq_mean_token_mean and no tis_cap")
    scale = 1.0 / temperature if temperature > 0 else 1.0

    def loss_fn(logits: torch.Tensor, rows: LabelRows) -> PolicyLoss:
        log_probs = F.log_softmax((logits * scale).float(), dim=-1)
        logp = torch.gather(log_probs, 2, rows.next_tokens[..., None]).squeeze(-1)
        mask = rows.next_token_mask.float()
        behaviour = rows.next_old_logprobs
        adv = rows.next_advantages
        trainer_minus_engine = (logp.detach() - behaviour) * mask
        engine_kl = torch.exp(trainer_minus_engine) - trainer_minus_engine - 1
        if ratio_level == "sequence":
            ratio = torch.exp(rows.next_seq_logratios + logp - logp.detach())
        else:
            ratio = torch.exp(logp - (logp.detach() if tis_cap else behaviour))
        clipped_ratio = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
        sums = {
            "rl/clip_fraction": ((ratio != clipped_ratio).float() * mask).sum().detach(),
            "rl/ratio": (ratio * mask).sum().detach(),
            "rl/engine_kl": engine_kl.sum(),  # 0 off the response: the difference is masked
            "rl/entropy": entropy_sum(log_probs, mask),
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
        if aggregation == "token_mean":
            return PolicyLoss((per_token * mask).sum(), mask.sum(), sums)
        sequences = (rows.next_inv_lens * mask).sum()
        if aggregation == "seq_mean_token_mean":
            per_token = per_token * rows.next_inv_lens
        norm = sequences * max_new_tokens if aggregation == "seq_mean_token_sum_norm" else sequences
        return PolicyLoss((per_token * mask).sum(), mask.sum(), sums, norm)

    return loss_fn
