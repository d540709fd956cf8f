"""Chunked policy head and draft soft CE: the unchunked values and gradients, one chunk alive."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_cotrain.cotrain.vocab import chunked_policy_head, chunked_soft_ce, slice_rows
from titan_cotrain.data.batch import LabelRows
from titan_cotrain.models.transformer import RMSNorm
from titan_cotrain.parallel.context_parallel import CPBatch
from titan_cotrain.rl.grpo import next_token_loss, ppo_loss
from titan_cotrain.simulate.memory import MemoryTracker

B, S, H, V, V_D = 2, 13, 16, 50, 20
T = B * S
LOSSES = {"next_token": next_token_loss, "ppo_kl": ppo_loss(0.2, 0.28, kl_coef=0.1, temperature=0.7)}
# Uneven (T = 26 is not a multiple of 7), exactly T, more than T.
CHUNKS = [7, T, 64]


def _rows(generator: torch.Generator, b: int = B, s: int = S, vocab: int = V) -> LabelRows:
    """RL rows: random targets, ~70% of them trained on, behaviour / reference log-probs
    near a uniform policy's (so the PPO ratios stay moderate)."""
    uniform = -torch.log(torch.tensor(float(vocab)))
    return LabelRows(
        next_tokens=torch.randint(0, vocab, (b, s), generator=generator),
        next_token_mask=torch.rand(b, s, generator=generator) < 0.7,
        next_advantages=torch.randn(b, s, generator=generator),
        next_old_logprobs=uniform + 0.3 * torch.randn(b, s, generator=generator),
        next_ref_logprobs=uniform + 0.3 * torch.randn(b, s, generator=generator),
    )


def _draft_vocab(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    draft_ids = torch.randperm(V, generator=generator)[:V_D].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids, t2d


def _policy_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    return hidden, weight, _rows(g), *_draft_vocab(g)


def test_slice_rows_keeps_the_type_and_cuts_every_tensor_field():
    g = torch.Generator().manual_seed(0)
    full = _rows(g)
    rows = CPBatch(tokens=torch.arange(T).view(B, S), loss_mask=torch.ones(B, S, dtype=torch.bool),
                   next_tokens=full.next_tokens, next_token_mask=full.next_token_mask, next_advantages=None)
    cut = slice_rows(rows, 10, 17)
    assert type(cut) is CPBatch and cut.next_advantages is None
    assert cut.tokens.tolist() == [list(range(10, 17))]
    torch.testing.assert_close(cut.next_tokens, full.next_tokens.flatten()[10:17][None])
    torch.testing.assert_close(cut.next_token_mask, full.next_token_mask.flatten()[10:17][None])


def test_slice_rows_rejects_a_field_not_shaped_like_the_rows():
    rows = LabelRows(torch.zeros(B, S, dtype=torch.long), torch.ones(B, S, dtype=torch.bool),
                     next_advantages=torch.zeros(B))
    with pytest.raises(ValueError, match="not \\[B, S\\]"):
        slice_rows(rows, 0, 4)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_policy_head_matches_the_whole_logits(loss, chunk_tokens):
    loss_fn = LOSSES[loss]
    hidden, weight, rows, draft_ids, t2d = _policy_inputs()
    out = chunked_policy_head(hidden, weight, rows, loss_fn, chunk_tokens=chunk_tokens, draft_ids=draft_ids,
                              t2d=t2d, teacher_dtype=torch.float32)
    grads = torch.autograd.grad(0.37 * out.policy.loss_sum, (hidden, weight))

    logits = (hidden @ weight.T).float().view(B, S, V)
    ref = loss_fn(logits, rows)
    ref_grads = torch.autograd.grad(0.37 * ref.loss_sum, (hidden, weight))
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.policy.loss_sum, ref.loss_sum, **close)
    torch.testing.assert_close(out.policy.count, ref.count)
    assert out.policy.metric_sums.keys() == ref.metric_sums.keys()
    for name, value in ref.metric_sums.items():
        torch.testing.assert_close(out.policy.metric_sums[name], value, **close)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **close)
    flat = logits.detach().view(T, V)
    torch.testing.assert_close(out.teacher_logprobs, F.log_softmax(flat[:, draft_ids], dim=-1), **close)
    assert torch.equal(out.teacher_in_vocab, t2d[flat.argmax(-1)])


def test_policy_head_teacher_is_bf16_by_default_and_optional():
    hidden, weight, rows, draft_ids, t2d = _policy_inputs(seed=1)
    out = chunked_policy_head(hidden, weight, rows, next_token_loss, chunk_tokens=8, draft_ids=draft_ids, t2d=t2d)
    want = F.log_softmax((hidden @ weight.T).detach()[:, draft_ids], dim=-1)
    assert out.teacher_logprobs.dtype == torch.bfloat16 and not out.teacher_logprobs.requires_grad
    torch.testing.assert_close(out.teacher_logprobs.float(), want, rtol=2**-8, atol=0)
    without = chunked_policy_head(hidden, weight, rows, next_token_loss, chunk_tokens=8)
    assert without.teacher_logprobs is None and without.teacher_in_vocab is None


def _draft_head(seed: int = 3) -> nn.Module:
    """The draft's ``norm`` + ``lm_head``."""
    g = torch.Generator().manual_seed(seed)
    head = nn.Sequential(RMSNorm(H, 1e-5), nn.Linear(H, V_D, bias=False))
    with torch.no_grad():
        head[0].weight.uniform_(0.5, 1.5, generator=g)
        head[1].weight.normal_(0.0, 0.5, generator=g)
    return head


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_soft_ce_matches_boolean_indexing(chunk_tokens):
    g = torch.Generator().manual_seed(4)
    t_ext = T + 5  # teacher rows extended by a (CP) halo
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    teacher = F.log_softmax(2 * torch.randn(t_ext, V_D, generator=g), dim=-1)
    index = torch.randint(0, t_ext, (T,), generator=g)
    mask = torch.rand(T, generator=g) < 0.6
    head = _draft_head()
    params = (hidden, *head.parameters())

    ce_sum, correct, count, overlap = chunked_soft_ce(hidden, head, teacher, index, mask, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(0.37 * ce_sum, params)

    logits = head(hidden[mask]).float()
    target = teacher[index[mask]]
    ref_ce = -(F.softmax(target, dim=-1) * F.log_softmax(logits, dim=-1)).sum()
    ref_grads = torch.autograd.grad(0.37 * ref_ce, params)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ce_sum, ref_ce, **close)
    assert correct.item() == (logits.argmax(-1) == target.argmax(-1)).sum().item()
    assert count.item() == mask.sum().item()
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **close)
    # Sampling's acceptance chance, in float64 from the probabilities: sum_x min(p(x), q(x)).
    p64, q64 = F.softmax(target.double(), dim=-1), F.softmax(logits.detach().double(), dim=-1)
    torch.testing.assert_close(overlap.double(), torch.minimum(p64, q64).sum(), rtol=1e-5, atol=1e-5)
    assert not overlap.requires_grad


# Memory: real CPU tensors, every op's output counted live until freed. A chunk of 128
# tokens is 1/8 of the whole.
MEM_T, MEM_H, MEM_V, MEM_V_D, MEM_CHUNK = 1024, 32, 8192, 2048, 128


class _LiveBytes(TorchDispatchMode):
    """Hands every op's outputs to a ``MemoryTracker`` (the simulator's accounting of live
    storages, here on real tensors). ``count(*inputs)`` counts tensors made outside too,
    so that views of them are not taken for new storages."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = MemoryTracker()

    def count(self, *objects) -> int:
        for t in tree_leaves([vars(o) if isinstance(o, LabelRows) else o for o in objects]):
            if isinstance(t, torch.Tensor):
                self.tracker(t)
        return self.tracker.live_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count(out)
        return out


def _peak_above_inputs(run, *inputs) -> int:
    """Peak live bytes above the ``inputs``' while ``run()`` runs forward and backward."""
    live = _LiveBytes()
    base = live.count(*inputs)
    with live:
        run()
    return live.tracker.peak_bytes - base


def _mem_policy_inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(MEM_T, MEM_H, generator=g).requires_grad_()
    weight = torch.randn(MEM_V, MEM_H, generator=g).requires_grad_()
    t2d = torch.zeros(MEM_V, dtype=torch.bool)
    return hidden, weight, _rows(g, 1, MEM_T, MEM_V), torch.arange(MEM_V_D), t2d


def test_policy_head_peak_is_about_one_chunk():
    loss_fn = LOSSES["ppo_kl"]
    hidden, weight, rows, draft_ids, t2d = inputs = _mem_policy_inputs()

    def chunked():
        out = chunked_policy_head(hidden, weight, rows, loss_fn, chunk_tokens=MEM_CHUNK, draft_ids=draft_ids, t2d=t2d)
        out.policy.loss_sum.backward()  # the teacher (``out``) alive, as until the draft's backward

    def whole():
        logits = (hidden @ weight.T).float()[None]
        teacher = logits.detach()[0][:, draft_ids]
        loss_fn(logits, rows).loss_sum.backward()
        del teacher

    chunk = MEM_CHUNK * MEM_V * 4
    kept = MEM_T * MEM_V_D * 2 + (MEM_T + MEM_V) * MEM_H * 4  # bf16 teacher, fp32 gradients
    peak = _peak_above_inputs(chunked, *inputs)
    # In backward: logits, their log-softmax, and the gradients of both (4 x [c, V] fp32).
    assert peak <= kept + 4.5 * chunk, (peak - kept) / chunk
    hidden.grad = weight.grad = None
    whole_peak = _peak_above_inputs(whole, *inputs)
    assert whole_peak > 3 * MEM_T * MEM_V * 4  # the control: the same count sees whole logits


def test_soft_ce_peak_is_about_one_chunk():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(MEM_T, MEM_H, generator=g).requires_grad_()
    teacher = torch.randn(MEM_T, MEM_V_D, generator=g).to(torch.bfloat16)
    index = torch.randint(0, MEM_T, (MEM_T,), generator=g)
    mask = torch.ones(MEM_T, dtype=torch.bool)
    head = nn.Sequential(RMSNorm(MEM_H, 1e-5), nn.Linear(MEM_H, MEM_V_D, bias=False))

    def run():
        ce_sum, *_ = chunked_soft_ce(hidden, head, teacher, index, mask, chunk_tokens=MEM_CHUNK)
        ce_sum.backward()

    chunk = MEM_CHUNK * MEM_V_D * 4
    # Gradients of hidden (twice while the chunks' are joined) and of lm_head (twice while
    # autograd adds one chunk's to the sum).
    kept = (2 * MEM_T * MEM_H + 2 * MEM_V_D * MEM_H) * 4
    peak = _peak_above_inputs(run, hidden, teacher, index, mask, *head.parameters())
    # Logits, log-softmax, teacher probabilities and a gradient: ~4 x [c, V_d] fp32.
    assert peak <= kept + 5 * chunk, (peak - kept) / chunk
