"""Tasks and rewards, GRPO advantages, the PPO-clipped loss, and rollout packing."""

import random
import re

import pytest
import torch

from titan_cotrain.rl.batching import Sample, pack_samples
from titan_cotrain.data.batch import labels_of
from titan_cotrain.rl.grpo import group_advantages, ppo_loss
from titan_cotrain.rl.tasks import get_task


def test_arithmetic_demonstrations_earn_reward_and_mix_styles():
    task = get_task("arithmetic")
    rng = random.Random(0)
    form_counts, fillers, gaps = [0, 0, 0, 0], 0, 0
    for _ in range(200):
        problem = task.sample(rng)
        demo = task.demonstration(problem, rng)
        assert demo.endswith(f"#{problem.answer}") and "  " not in demo
        d = task.details(problem, demo)
        assert d["answer_correct"] == d["steps_correct"] == 1.0
        assert task.reward(problem, demo) == pytest.approx(0.6 + 0.4 * d["steps_preferred"] - 0.05 * d["fillers"])
        total = problem.numbers[0]
        compact = demo.replace(" ", "")
        for written, x in zip(compact.split(";"), problem.numbers[1:]):
            form_counts[task.step_forms(total, x).index(written)] += 1
            total += x
        working = compact.split("#")[0]
        fillers += d["fillers"]
        gaps += len(working) - sum(len(n) - 1 for n in re.findall(r"\d+", working))  # numbers and signs
        assert not re.search(r"\d \d", demo), "a filler never splits a number"
    # Each step picks one of the four forms at random (about 600 steps: 150 +- 40 each),
    # and a filler follows about 30% of the numbers and signs.
    assert all(110 <= c <= 190 for c in form_counts), form_counts
    assert 0.27 <= fillers / gaps <= 0.33, fillers / gaps


def test_arithmetic_reward_prefers_running_sum_first():
    task = get_task("arithmetic")
    problem = task.sample(random.Random(1))
    a, b, *rest = problem.numbers
    preferred, total = [], a
    for x in problem.numbers[1:]:
        preferred.append(f"{total}+{x}={total + x}")
        total += x
    assert task.reward(problem, ";".join(preferred) + f";#{total}") == 1.0
    assert task.reward(problem, f"#{total}") == pytest.approx(0.4)  # right answer, no working
    assert task.reward(problem, f"#{total + 1}") == 0.0
    assert task.reward(problem, "garbage") == 0.0
    swapped = f"{b}+{a}={a + b};" + ";".join(preferred[1:]) + f";#{total}"
    assert task.reward(problem, swapped) == pytest.approx(1.0 - 0.4 / len(preferred))
    result_first = f"{a + b}={a}+{b};" + ";".join(preferred[1:]) + f";#{total}"
    assert task.reward(problem, result_first) == pytest.approx(1.0 - 0.4 / len(preferred))
    wrong_answer = ";".join(preferred) + f";#{total + 1}"
    assert task.reward(problem, wrong_answer) == pytest.approx(0.6)
    assert task.details(problem, swapped) == {"answer_correct": 1.0, "steps_correct": 1.0, "fillers": 0.0,
                                              "steps_preferred": pytest.approx(1 - 1 / len(preferred))}
    # Fillers do not change what the working says; each one costs 0.05.
    padded = " ; ".join(p.replace("+", " + ") for p in preferred) + f";#{total}"
    assert task.details(problem, padded)["steps_preferred"] == 1.0
    assert task.reward(problem, padded) == pytest.approx(1.0 - 0.05 * padded.count(" "))


def test_sort_reward_gives_partial_credit():
    task = get_task("sort")
    problem = task.sample(random.Random(2))
    assert task.reward(problem, task.demonstration(problem, random.Random(0))) == 1.0
    assert 0 <= task.reward(problem, "1,2#") < 1.0
    assert task.reward(problem, "") == 0.0


def test_longtail_arithmetic_lengths_follow_the_stated_pareto_law():
    task, rng = get_task("arithmetic_longtail"), random.Random(0)
    problems = [task.sample(rng) for _ in range(20000)]
    steps = torch.tensor([len(p.numbers) - 1 for p in problems], dtype=torch.float64)
    assert steps.min() == task.min_steps and steps.max() == task.max_steps
    # P(steps >= s) = (min_steps / s) ** alpha below the cap; the cap holds the rest of the mass.
    for s in (3, 5, 11, 24):
        law = (task.min_steps / s) ** task.alpha
        measured = float((steps >= s).double().mean())
        assert abs(measured - law) < 4 * (law * (1 - law) / len(problems)) ** 0.5 + 1e-3, (s, measured, law)
    # A demonstration has one working step per term after the first, and earns the full reward.
    long = next(p for p in problems if len(p.numbers) == task.max_steps + 1)
    text = task.demonstration(long, rng)
    assert text.count(";") == task.max_steps and task.details(long, text)["answer_correct"] == 1.0


def test_tasks_are_deterministic_and_unknown_names_fail():
    task = get_task("arithmetic")
    assert [task.sample(random.Random(5)) for _ in range(2)][0] == task.sample(random.Random(5))
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        get_task("chess")


def test_group_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]), 4)
    assert adv[:4].sum().abs() < 1e-6 and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(4))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 4)


def _samples():
    return [
        Sample(prompt=[5, 6], response=[7, 8, 2], logprobs=[-1.0, -2.0, -0.5], reward=1.0, advantage=0.7),
        Sample(prompt=[5], response=[9, 2], logprobs=[-0.3, -0.2], reward=0.0, advantage=-0.7),
        Sample(prompt=[5, 5, 5, 5], response=[6, 6, 6, 6, 2], logprobs=[-0.1] * 5, reward=0.0, advantage=0.1),
    ]


def test_packing_places_every_sample_once():
    batch = pack_samples(_samples(), seq_len=10, pad_id=0)
    assert batch.tokens.shape == (2, 10)
    assert int(batch.loss_mask.sum()) == 3 + 2 + 5
    # Row 0: the 9-token sample then padding; row 1: the 5- and 3-token samples then padding.
    assert batch.tokens[0, :9].tolist() == [5, 5, 5, 5, 6, 6, 6, 6, 2]
    assert batch.loss_mask[0].tolist() == [False] * 4 + [True] * 5 + [False]
    assert batch.document_ids[0].tolist() == [0] * 9 + [1]
    assert batch.tokens[1, :8].tolist() == [5, 6, 7, 8, 2, 5, 9, 2]
    assert batch.old_logprobs[1, 2:5].tolist() == [-1.0, -2.0, -0.5]
    assert batch.advantages[1, 6:8].tolist() == pytest.approx([-0.7, -0.7])
    assert pack_samples(_samples(), seq_len=10, pad_id=0, rows_multiple_of=4).tokens.shape[0] == 4


def test_packing_skips_overlong_and_refuses_empty(caplog):
    batch = pack_samples(_samples(), seq_len=6, pad_id=0)
    assert int(batch.loss_mask.sum()) == 5
    assert "skipped 1 of 3" in caplog.text
    with pytest.raises(ValueError, match="no trainable sample"):
        pack_samples(_samples(), seq_len=2, pad_id=0)


def _document_lengths(document_ids: torch.Tensor) -> list[list[int]]:
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in document_ids]


def test_cp_packing_fills_each_rows_cp_layout_exactly():
    """``pad_to = 2 cp``: a document spans its length rounded up to a multiple of 2 cp (the
    padding inside it, out of the loss), so the zigzag layout of every row is exactly
    ``seq_len`` tokens; plain packing can overflow it (the CP layout pads each document)."""
    from titan_cotrain.parallel.context_parallel import plan_padded_rows

    samples = _samples()  # lengths 5, 3, 9
    plain = pack_samples(samples, seq_len=12, pad_id=0)
    with pytest.raises(ValueError, match="more than the CP row"):
        plan_padded_rows(_document_lengths(plain.document_ids), world=2, row_len=12)  # row 0: 9 + 3 -> 12 + 4
    batch = pack_samples(samples, seq_len=12, pad_id=0, pad_to=4)
    assert _document_lengths(batch.document_ids) == [[12], [8, 4]]
    padded, row_len = plan_padded_rows(_document_lengths(batch.document_ids), world=2, row_len=12)
    assert padded == [[12], [8, 4]] and row_len == 12  # the CP layout adds no padding
    assert batch.tokens[1].tolist() == [5, 6, 7, 8, 2, 0, 0, 0, 5, 9, 2, 0]
    assert batch.loss_mask[1].tolist() == [False] * 2 + [True] * 3 + [False] * 4 + [True] * 2 + [False]
    # The in-document padding is out of every loss: the trained labels are plain packing's.
    a, b = labels_of(plain), labels_of(batch)
    for field in ("next_tokens", "next_advantages", "next_old_logprobs"):
        trained = (sorted(getattr(rows, field)[rows.next_token_mask].tolist()) for rows in (a, b))
        assert next(trained) == next(trained), field
    with pytest.raises(ValueError, match="divisor of seq_len"):
        pack_samples(samples, seq_len=10, pad_id=0, pad_to=4)


def _token_logprobs(logits, tokens):
    """Independent reference: log p(tokens[b, t]) from logits[b, t - 1], by a loop."""
    out = torch.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            out[b, t] = torch.log_softmax(logits[b, t - 1], -1)[tokens[b, t]]
    return out


def test_labels_shift_inside_documents():
    batch = pack_samples(_samples(), seq_len=10, pad_id=0)
    rows = labels_of(batch)
    assert rows.next_tokens[1].tolist() == [6, 7, 8, 2, 0, 9, 2, 0, 0, 0]
    assert rows.next_token_mask[1].tolist() == [False, True, True, True, False, True, True, False, False, False]
    assert rows.next_old_logprobs[1, 1:4].tolist() == [-1.0, -2.0, -0.5]


def test_ppo_loss_matches_a_direct_computation():
    torch.manual_seed(0)
    batch = pack_samples(_samples(), seq_len=10, pad_id=0)
    logits = torch.randn(2, 10, 12, requires_grad=True)
    loss_sum, count, sums, _ = ppo_loss(0.2, 0.3, temperature=0.5)(logits, labels_of(batch))
    assert count == 10
    logp = _token_logprobs(logits.detach() / 0.5, batch.tokens)
    expected = 0.0
    for b in range(2):
        for t in range(1, 10):
            if batch.loss_mask[b, t]:
                r = torch.exp(logp[b, t] - batch.old_logprobs[b, t])
                a = batch.advantages[b, t]
                expected = expected - torch.minimum(r * a, r.clamp(0.8, 1.3) * a)
    torch.testing.assert_close(loss_sum.detach(), expected)
    assert 0 <= sums["rl/clip_fraction"] <= count
    # On-policy (ratio 1): nothing is clipped and the gradient is -A * grad log p, summed
    # over the response tokens (grad log p computed independently, by autograd per token).
    on_policy = pack_samples(_samples(), seq_len=10, pad_id=0)
    on_policy.old_logprobs = torch.where(on_policy.loss_mask, _token_logprobs(logits.detach(), on_policy.tokens), 0.0)
    loss_sum, _, sums, _ = ppo_loss(0.2, 0.2)(logits, labels_of(on_policy))
    assert sums["rl/clip_fraction"] == 0
    (grad,) = torch.autograd.grad(loss_sum, logits)
    expected = torch.zeros_like(logits)
    for b in range(2):
        for t in range(1, 10):
            if on_policy.loss_mask[b, t]:
                x = logits.detach()[b, t - 1].clone().requires_grad_()
                (g,) = torch.autograd.grad(torch.log_softmax(x, -1)[on_policy.tokens[b, t]], x)
                expected[b, t - 1] -= on_policy.advantages[b, t] * g
    assert expected.abs().sum() > 0
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_truncated_importance_sampling_weights_the_on_policy_gradient_and_logs_the_engine_kl():
    """``tis_cap``: the ratio is against the trainer's own log-probs ``l`` (so it is 1 and
    nothing clips), each token's gradient ``-A grad l`` is weighted by ``min(exp(l - b), cap)``
    (``b``: the engine's log-prob), and ``rl/engine_kl`` is ``sum exp(l - b) - (l - b) - 1``;
    checked against a direct float64 computation, token by token."""
    batch = pack_samples(_samples(), seq_len=10, pad_id=0)
    logits = torch.randn(2, 10, 12, generator=torch.Generator().manual_seed(3), requires_grad=True)
    trainer = _token_logprobs(logits.detach().double(), batch.tokens)
    offsets = torch.randn(2, 10, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    batch.old_logprobs = torch.where(batch.loss_mask, trainer + offsets, 0.0).float()  # the engine's
    cap = 1.5
    loss_sum, count, sums, _ = ppo_loss(0.2, 0.2, tis_cap=cap)(logits, labels_of(batch))
    (grad,) = torch.autograd.grad(loss_sum, logits)
    expected_grad, expected_kl, truncated = torch.zeros_like(logits, dtype=torch.float64), 0.0, 0
    for b in range(2):
        for t in range(1, 10):
            if batch.loss_mask[b, t]:
                d = trainer[b, t] - batch.old_logprobs[b, t].double()
                expected_kl += float(torch.exp(d) - d - 1)
                truncated += int(torch.exp(d) > cap)
                x = logits.detach()[b, t - 1].double().requires_grad_()
                (g,) = torch.autograd.grad(torch.log_softmax(x, -1)[batch.tokens[b, t]], x)
                expected_grad[b, t - 1] -= batch.advantages[b, t] * torch.exp(d).clamp(max=cap) * g
    assert 0 < truncated < count and sums["rl/tis_truncated"] == truncated
    assert sums["rl/clip_fraction"] == 0 and abs(float(sums["rl/ratio"]) - float(count)) < 1e-5
    torch.testing.assert_close(float(sums["rl/engine_kl"]), expected_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)
    # Without TIS the loss is the engine-ratio PPO loss, and the same KL is logged.
    _, _, plain, _ = ppo_loss(0.2, 0.2)(logits, labels_of(batch))
    torch.testing.assert_close(float(plain["rl/engine_kl"]), expected_kl, rtol=1e-5, atol=1e-6)
    assert "rl/tis_truncated" not in plain


def test_kl_term_value_and_gradient():
    """k3 estimator ``exp(r - p) - (r - p) - 1`` (``p``, ``r``: the token's policy and reference
    log-probs): zero at the reference, and away from it the value and the gradient of the
    formula, checked against a direct float64 computation."""
    batch = pack_samples(_samples(), seq_len=10, pad_id=0)
    batch.advantages = torch.zeros_like(batch.advantages)  # the KL term alone
    logits = torch.randn(2, 10, 12, generator=torch.Generator().manual_seed(1), requires_grad=True)
    batch.ref_logprobs = _token_logprobs(logits.detach(), batch.tokens)
    batch.old_logprobs = batch.ref_logprobs.clone()
    _, _, sums, _ = ppo_loss(0.2, 0.2, kl_coef=0.1)(logits, labels_of(batch))
    assert sums["rl/kl_ref"].abs() < 1e-6
    reference = torch.randn(2, 10, 12, generator=torch.Generator().manual_seed(2))
    batch.ref_logprobs = _token_logprobs(reference, batch.tokens)
    loss_sum, _, sums, _ = ppo_loss(0.2, 0.2, kl_coef=0.1)(logits, labels_of(batch))
    (grad,) = torch.autograd.grad(loss_sum, logits)
    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    delta = batch.ref_logprobs[:, 1:].double() - logp
    mask = batch.loss_mask[:, 1:].double()
    kl = ((torch.exp(delta) - delta - 1) * mask).sum()
    (expected_grad,) = torch.autograd.grad(0.1 * kl, x)
    assert kl > 0.1  # far enough from the reference to mean something
    torch.testing.assert_close(sums["rl/kl_ref"].double(), kl.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_sum.detach().double(), 0.1 * kl.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-6)
