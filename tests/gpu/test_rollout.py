"""The rollout engine on the GPU in bf16: the compiled engine (CUDA graphs, ``reduce-overhead``)
against eager, speculative greedy against plain greedy, and lossless acceptance on device
tensors against the exact law.

bf16 greedy runs are not bitwise equal across kernels (decode vs verify shapes, compiled vs
eager fusions): two runs agree where the logits leave no doubt. ``margins`` recomputes the
reference run's top-2 logit gaps with one target forward per sequence. Token by token, while
both runs have emitted the same tokens they share the context, so they may part only where the
reference's gap is below ``MARGIN``; from there on nothing is compared.
"""

import functools

import pytest
import torch

from tests.gpu.conftest import DEVICE, DTYPE, ON_GPU
from tests.engine.test_rollout import _always_accept, _chi_square_p_value, _constant_draft, _prompts, _resample_from_p
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.engine.rollout import RolloutEngine, Rollouts
from titan_cotrain.engine.sampling import SamplingParams, sample, speculative_accept

pytestmark = pytest.mark.filterwarnings(r"ignore:\[rollout\] kv_block_size = 16 is not a multiple")
# The engine reaches the flash kernels only through the trunk and the paged pool, which
# test_attention.py and test_paged_attention.py check under both torch versions' stand-ins.
STAND_IN_VERSIONS = ("2.13",)

VOCAB, DRAFT_VOCAB, K = 6, 5, 2
# Blocks of 16 positions: decoding attends through the gathered path (the paged flash kernel,
# blocks of 256, is test_paged_attention.py's).
BLOCK = 16
SEQ_LEN, PARAMS = 48, SamplingParams(temperature=0, max_new_tokens=32)
# A clear argmax: a top-2 gap, in logit units, that two bf16 runs cannot close. Weights of
# std 0.3 amplify roundings: a bf16 forward of this model is off from the fp32 one by up to
# 0.37 in a logit (measured on the CPU, logits |x| < 8), so two bf16 runs differ by less than
# 0.75; the top-1 of a gap of 1.0 is theirs alike. (0.05, bf16's spacing at these logits,
# would be far inside that noise.)
MARGIN = 1.0
# Behaviour log-probs of the same token after the same context in two runs: a log-softmax
# moves by at most twice the largest logit change. bf16 against fp32 measured 0.17; 0.5.
LOGPROB_TOL = 0.5
# The test's power: at least this share of the response tokens is compared (a run that parts
# from the reference at its first gap below MARGIN compares a token or two per row).
MIN_COMPARED = 0.25


@pytest.fixture(scope="module")
def pair():
    """``(target, draft, prompts)``: a 4-layer llama3 debug target over 6 tokens, weights of std
    0.3 (large logits, clear margins), and ``tests/rl``'s constant draft proposing its most
    frequent greedy token, so that ragged multi-token acceptances are common."""
    args = model_args_for("llama3", "debugmodel").replace(vocab_size=VOCAB, n_layers=4)
    target = Transformer(args, tap_layers=(0, 1, 2))
    target.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    prompts = _prompts([3, 9, 5, 1, 7, 4], VOCAB)
    plain = RolloutEngine(target, max_batch_size=8, max_seq_len=SEQ_LEN).generate(prompts, PARAMS)
    draft = _constant_draft(target, int(plain.tokens.flatten().mode().values), DRAFT_VOCAB)
    return target.eval(), draft.eval(), prompts


def engine(pair, **kwargs) -> RolloutEngine:
    target, draft, _ = pair
    return RolloutEngine.from_models(target, draft, device=DEVICE, dtype=DTYPE, max_batch_size=8,
                                     max_seq_len=SEQ_LEN, max_draft_tokens=K, block_size=BLOCK, **kwargs)


@torch.no_grad()
def margins(policy: Transformer, prompts, reference: Rollouts) -> list[torch.Tensor]:
    """Per row of the greedy run ``reference``, the top-2 logit gap ``[n]`` at each of its
    response tokens, from one forward of ``policy`` over prompt + response. Where the gap is
    at least ``MARGIN``, that forward must pick the run's own token."""
    gaps = []
    for b, prompt in enumerate(prompts):
        n = int(reference.response_lens[b])
        response = reference.tokens[b, :n]
        sequence = torch.cat([prompt.to(response.device), response]).unsqueeze(0)
        logits = policy(sequence)[0, len(prompt) - 1: -1].float()  # the logits of response tokens 0..n-1
        top2 = logits.topk(2, dim=-1)
        gap = top2.values[:, 0] - top2.values[:, 1]
        disagree = (top2.indices[:, 0] != response) & (gap >= MARGIN)
        assert not disagree.any(), (
            f"row {b}: the forward's argmax differs from the engine's token at response positions "
            f"{disagree.nonzero().flatten().tolist()} despite a margin >= {MARGIN}")
        gaps.append(gap.cpu())
    return gaps


def assert_follows(run: Rollouts, reference: Rollouts, gaps: list[torch.Tensor]) -> None:
    """``run`` emits ``reference``'s tokens, row by row, until a position where the reference's
    margin is below ``MARGIN`` and the runs part (after which their contexts differ); up to
    there their behaviour log-probs agree to ``LOGPROB_TOL``."""
    compared = 0
    for b, gap in enumerate(gaps):
        n = gap.numel()
        differ = (run.tokens[b, :n] != reference.tokens[b, :n]).nonzero().flatten().cpu()
        end = int(differ[0]) if differ.numel() else n
        assert end == n or gap[end] < MARGIN, (
            f"row {b}: tokens differ at response position {end}, where the reference's margin is "
            f"{float(gap[end]):.3g} >= {MARGIN}")
        if end:
            logprob_gap = float((run.logprobs[b, :end] - reference.logprobs[b, :end]).abs().max())
            assert logprob_gap <= LOGPROB_TOL, f"row {b}: behaviour log-probs differ by {logprob_gap:.3g}"
        compared += end
    total = int(reference.response_lens.sum())
    assert compared >= MIN_COMPARED * total, f"only {compared} of {total} tokens compared: the test has no power"


def test_speculative_greedy_follows_plain_greedy(pair):
    """Greedy speculative decoding emits the target's argmax (docs/DESIGN.md section 6): in
    bf16, the verify forward's logits over k + 1 positions must pick what plain decoding's one
    position picks."""
    _, _, prompts = pair
    bf16_engine = engine(pair)
    plain = bf16_engine.generate(prompts, PARAMS, draft_tokens=0)
    speculative = bf16_engine.generate(prompts, PARAMS, draft_tokens=K)
    assert speculative.stats.acceptance_length > 1.2  # drafted tokens are accepted, often several a round
    assert_follows(speculative, plain, margins(bf16_engine.policy, prompts, plain))


def test_block_drafted_greedy_follows_plain_greedy(pair):
    """The same with the block drafter (``engine.block_rollout``): its one drafter forward a
    round, the flash kernels' verify over k + 1 positions, in bf16. A random drafter over 6
    tokens still proposes the target's token often enough for rounds to accept some."""
    from titan_cotrain.engine.block_rollout import BlockDraftEngine
    from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter

    target, _, prompts = pair
    drafter = BlockDrafter(BlockDraftArgs.from_target(target.args, n_layers=2, block_size=4,
                                                      target_layer_ids=target.tap_layers))
    drafter.init_weights(std=0.3, generator=torch.Generator().manual_seed(1))
    block_engine = BlockDraftEngine.from_models(target, drafter.eval(), device=DEVICE, dtype=DTYPE, max_batch_size=8,
                                                max_seq_len=SEQ_LEN, max_draft_tokens=3, block_size=BLOCK)
    plain = block_engine.generate(prompts, PARAMS, draft_tokens=0)
    speculative = block_engine.generate(prompts, PARAMS, draft_tokens=3)
    assert speculative.stats.acceptance_length > 1.0  # some drafted tokens are accepted
    assert_follows(speculative, plain, margins(block_engine.policy, prompts, plain))


@pytest.fixture
def fresh_compiler(monkeypatch):
    """No graph of an earlier engine left in dynamo's caches. Without a GPU, dynamo's ``eager``
    backend (as ``tests/engine/test_acceptance.py``): the engine's logic under dynamo, without
    inductor's CPU build; CUDA graphs and Triton kernels are the GPU's alone."""
    torch._dynamo.reset()
    if not ON_GPU:
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("draft_tokens", [0, K], ids=["plain", f"k{K}"])
def test_compiled_engine_follows_eager(pair, fresh_compiler, draft_tokens):
    """The compiled steps (target decode or verify, draft chain step and catch-up; CUDA graphs
    on a GPU) against the eager engine; the second call replays the graphs the first built."""
    _, _, prompts = pair
    eager = engine(pair)
    reference = eager.generate(prompts, PARAMS, draft_tokens=draft_tokens)
    gaps = margins(eager.policy, prompts, reference)
    compiled = engine(pair, compile=True)
    for call in range(2):
        run = compiled.generate(prompts, PARAMS, draft_tokens=draft_tokens)
        assert_follows(run, reference, gaps)
        if draft_tokens:
            assert run.stats.acceptance_length > 1.2, f"call {call}"


# speculative_accept on its own: a 5-token target vocabulary, a 4-token draft vocabulary
# (draft id i is target id i + 1, so target token 0 comes only from a residual or a bonus
# draw), k = 2 drafted tokens, every distribution conditioned on the tokens before it.
V, V_DRAFT, N_DRAWS = 5, 4, 20000


def _conditional(table: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """Probabilities ``[N, C]`` of ``table [V] * j + [C]`` (logits) after ``prefix [N, j]``."""
    return table[tuple(prefix.t())].softmax(-1).expand(prefix.shape[0], -1)


def _emitted_law(rule, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts of the ``V ** (K + 1)`` sequences of ``K + 1`` tokens that one round of ``rule``
    emits, completed by exact draws from the target (the next round's tokens), over
    ``N_DRAWS`` rounds on ``DEVICE``; the target's exact law of those sequences; and how
    often the round accepted ``0 .. K`` drafted tokens."""
    g = torch.Generator().manual_seed(5)
    target = [torch.randn((V,) * j + (V,), generator=g) * 1.5 for j in range(K + 1)]
    # The draft: the target's logits on its vocabulary, perturbed; near enough to be accepted often.
    draft = [target[j][..., 1:] + torch.randn((V,) * j + (V_DRAFT,), generator=g) for j in range(K)]
    draft_to_target = torch.arange(1, V, device=DEVICE)

    drafted, draft_probs = [], []  # draft ids [N] and q [N, V_DRAFT] per position
    prefix = torch.zeros(N_DRAWS, 0, dtype=torch.int64, device=DEVICE)
    for j in range(K):
        draft_probs.append(_conditional(draft[j].to(DEVICE), prefix))
        drafted.append(sample(draft_probs[-1], generator))
        prefix = torch.cat([prefix, draft_to_target[drafted[-1]].unsqueeze(1)], 1)
    target_probs = torch.stack([_conditional(target[j].to(DEVICE), prefix[:, :j]) for j in range(K + 1)], 1)
    n_accepted, next_token = rule(torch.stack(drafted, 1), torch.stack(draft_probs, 1), draft_to_target,
                                  target_probs, generator)
    n_accepted, next_token = n_accepted.to(DEVICE), next_token.to(DEVICE)

    emitted = torch.zeros(N_DRAWS, K + 1, dtype=torch.int64, device=DEVICE)
    for j in range(K + 1):
        fresh = sample(_conditional(target[j].to(DEVICE), emitted[:, :j]), generator)
        drafted_j = prefix[:, j] if j < K else fresh
        emitted[:, j] = torch.where(j < n_accepted, drafted_j, torch.where(j == n_accepted, next_token, fresh))
    cells = (emitted * V ** torch.arange(K, -1, -1, device=DEVICE)).sum(-1)
    counts = torch.bincount(cells, minlength=V ** (K + 1)).cpu()
    accepted = torch.bincount(n_accepted, minlength=K + 1).cpu()

    grid = torch.cartesian_prod(*[torch.arange(V)] * (K + 1))  # cell order: first token slowest
    exact = torch.stack([_conditional(target[j].double(), grid[:, :j]).gather(1, grid[:, j:j + 1])[:, 0]
                         for j in range(K + 1)]).prod(0)
    return counts, exact, accepted


@pytest.mark.parametrize("rule, lossless", [(speculative_accept, True), (_always_accept, False),
                                            (_resample_from_p, False)],
                         ids=["speculative_accept", "always_accept", "resample_from_p"])
def test_speculative_accept_on_device_keeps_the_target_law(rule, lossless):
    """Chi-square (``tests/engine/test_rollout.py``'s) of the emitted tokens against the target's
    exact law, with ``tests/rl``'s broken rules, which must fail the same test."""
    counts, exact, accepted = _emitted_law(rule, torch.Generator(DEVICE).manual_seed(0))
    p_value = _chi_square_p_value(counts, exact)
    if lossless:
        assert (accepted > N_DRAWS // 20).all(), f"rounds accepting 0..{K}: {accepted.tolist()}"  # every branch runs
        assert p_value > 1e-3, f"p = {p_value:.3g}"
    else:
        assert p_value < 1e-6, f"p = {p_value:.3g}"
