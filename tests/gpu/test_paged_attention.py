"""The engine's paged flash path: ``PagedKV.attend`` through torch's ``varlen_attn`` with
``block_table`` (torch >= 2.13) against the gathered path (``cached_attention``) on the same
bf16 pool, and both against a float64 reference. On a torch without the paged kernel (2.11,
2.12) ``attend`` must take the gathered path, which is then what is checked.

Tolerance rule: the gathered path computes in fp32 and rounds its output to bf16, so its
error against float64 is the rounding floor; the kernel (bf16 P @ V) may be a few times that.
``C = 4`` times the floor, plus ``1e-3`` for outputs whose floor is exactly 0.
"""

import pytest
import torch

from tests.gpu.conftest import DEVICE
from titan_cotrain.models import kv_cache
from titan_cotrain.models.kv_cache import KVPool
from titan_cotrain.ops import flash

C, FLOOR = 4.0, 1e-3
BLOCK = flash.PAGE_MULTIPLE


def _reference(q, keys, values, seqused):
    """float64 attention of ``q [B, s, Hq, Dh]`` over gathered ``keys [B, Hkv, L, Dh]``."""
    b, s, hq, dh = q.shape
    rep = hq // keys.shape[1]
    k, v = (x.double().repeat_interleave(rep, 1) for x in (keys, values))
    scores = torch.einsum("bshd,bhld->bshl", q.double(), k) * dh ** -0.5
    pos = seqused.view(b, 1) - s + torch.arange(s, device=q.device)
    scores = scores.masked_fill(torch.arange(keys.shape[2], device=q.device).view(1, 1, 1, -1) > pos.view(b, s, 1, 1),
                                float("-inf"))
    return torch.einsum("bshl,bhld->bshd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def _pool_and_table(b, nb, hkv, dh, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pool = KVPool(1, 1 + b * nb, BLOCK, hkv, dh, torch.bfloat16, DEVICE)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    blocks = torch.randperm(b * nb, generator=torch.Generator().manual_seed(seed)) + 1  # scattered, never scratch
    return pool, blocks.view(b, nb).to(DEVICE)


@pytest.fixture
def paged_calls(monkeypatch):
    """The calls that reach ``flash.paged_forward`` (the paged kernel)."""
    calls = []
    kernel = flash.paged_forward
    monkeypatch.setattr(flash, "paged_forward", lambda *args: calls.append(1) or kernel(*args))
    return calls


@pytest.mark.parametrize("s", [1, 4, 37])  # decode, verify of k = 3, a ragged prefill
@pytest.mark.parametrize("hq,hkv,dh", [(8, 8, 64), (16, 2, 128), (8, 1, 256)])
def test_paged_kernel_matches_gathered_path(s, hq, hkv, dh, paged_calls):
    b, nb = 5, 3
    pool, table = _pool_and_table(b, nb, hkv, dh, seed=s + dh)
    view = pool.view(table)
    seqused = torch.tensor([s, 2 * BLOCK + 7, BLOCK, 3 * BLOCK, s + 300], device=DEVICE)
    q = torch.randn(b, s, hq, dh, device=DEVICE, dtype=torch.bfloat16)
    out, lse = view.attend(0, q, seqused, return_lse=True)  # the kernel, where this torch has it
    assert len(paged_calls) == flash.has_paged_kernel()
    keys, values = view.read(0)
    gathered, gathered_lse = kv_cache.cached_attention(q, keys, values, seqused, return_lse=True)
    want, want_lse = _reference(q, keys, values, seqused)
    floor = (gathered.double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= C * floor + FLOOR
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-2)
    torch.testing.assert_close(gathered_lse.double(), want_lse, rtol=0, atol=1e-4)


def test_engine_greedy_tokens_agree_between_kernel_and_gathered_path(monkeypatch, paged_calls):
    """Whole greedy rollouts through the target and the draft: the paged kernel against the
    gathered path on the same bf16 engine (block size 256). Not bitwise: the two round
    differently, and this model's bf16 logits tie often (top-2 gaps of 0 and one ulp), so the
    runs must agree by ``test_rollout.py``'s margin rule: token for token until a position
    where the gathered run's top-2 gap is below ``MARGIN``. Without the paged kernel the
    engine must never reach it."""
    from tests.engine.test_rollout import _models, _prompts  # the rollout tests' tiny models
    from tests.gpu.test_rollout import assert_follows, margins
    from titan_cotrain.engine.rollout import RolloutEngine
    from titan_cotrain.engine.sampling import SamplingParams

    target, draft = (m.to(DEVICE, torch.bfloat16) for m in _models(draft_vocab=200))
    prompts = _prompts([3, 9, 5, 1], 256, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    engine = RolloutEngine(target, draft, max_batch_size=4, max_seq_len=64, max_draft_tokens=3, block_size=BLOCK)
    got = engine.generate(prompts, params)
    assert bool(paged_calls) == flash.has_paged_kernel(), f"{len(paged_calls)} paged kernel calls"
    if not paged_calls:
        return
    monkeypatch.setattr(kv_cache, "_paged_kernel_runs", lambda q, pool: False)
    want = engine.generate(prompts, params)
    assert_follows(got, want, margins(engine.policy, prompts, want))
