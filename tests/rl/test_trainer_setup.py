"""What the trainer sets up from the draft's and the schedule's keys, on tiny one-process jobs
run in this process: each phase's own LR schedule (read from the optimizers' param groups at
every update), every combination of ``[draft] enable`` and ``[rollout] speculative`` that
runs, the reduced draft vocabulary counted on task samples or the policy's generations, and
the exported draft's positions (RoPE and context) read back against the policy's."""

import json
import math
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from titan_cotrain.config import load_job_config
from titan_cotrain.models.args import RopeScaling
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.rl.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = ("--task.sft_batch_size", "4", "--rl.prompts_per_step", "2", "--rl.group_size", "2",
        "--rollout.max_new_tokens", "8", "--training.seq_len", "64", "--checkpoint.no-enable",
        "--metrics.no-enable_tensorboard")


# Tiny models are launch-bound: one intra-op thread, so shared cores do not spin-wait.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _trainer(folder: Path, *overrides: str) -> Trainer:
    config = load_job_config([*TINY, "--job.dump_folder", str(folder), *overrides], world_size=1)
    return Trainer(config, world_size=1, rank=0)


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _record_lrs(optimizers) -> list[float]:
    """The LR of every param group at each ``step()`` of ``optimizers`` (one value per update:
    the groups agree)."""
    seen = []
    step = optimizers.step

    def recording_step(*args, **kwargs):
        lrs = {group["lr"] for optimizer in optimizers for group in optimizer.param_groups}
        assert len(lrs) == 1
        seen.append(lrs.pop())
        return step(*args, **kwargs)

    optimizers.step = recording_step
    return seen


def _factor(i: int, steps: int, warmup: int, decay: str, min_factor: float) -> float:
    """torchtitan's warm-up / decay at 0-based update ``i`` of a phase of ``steps`` updates: a
    linear ramp to the peak over ``warmup`` updates, the peak held one more, then the decay
    from 1 to ``min_factor`` reached at the virtual update ``steps``."""
    if i < warmup:
        return (i + 1) / warmup
    if i < warmup + 1:
        return 1.0
    progress = (i + 1 - (warmup + 1)) / (steps - warmup)
    shape = 1 - progress if decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_factor + (1 - min_factor) * shape


def test_the_warm_start_and_rl_each_run_their_own_lr_schedule(tmp_path):
    sft = dict(steps=5, warmup=2, decay="linear", min_factor=0.5)
    rl = dict(steps=5, warmup=3, decay="cosine", min_factor=0.1)
    trainer = _trainer(
        tmp_path, "--task.sft_steps", "5", "--training.steps", "5",
        "--task.sft_lr", "3e-3", "--task.sft_warmup_steps", "2", "--task.sft_decay_type", "linear",
        "--task.sft_min_lr_factor", "0.5",
        "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_type", "cosine",
        "--lr_scheduler.min_lr_factor", "0.1", "--draft.sft_lr", "2e-3", "--draft.lr", "5e-4")
    policy, draft = _record_lrs(trainer.policy_opt), _record_lrs(trainer.draft_opt)
    trainer.run()
    expected_policy = ([3e-3 * _factor(i, **sft) for i in range(5)] + [1e-4 * _factor(i, **rl) for i in range(5)])
    expected_draft = ([2e-3 * _factor(i, **sft) for i in range(5)] + [5e-4 * _factor(i, **rl) for i in range(5)])
    assert policy == pytest.approx(expected_policy, rel=1e-12, abs=0)
    assert draft == pytest.approx(expected_draft, rel=1e-12, abs=0)
    # The first RL update runs at the RL schedule's first value, not at the warm start's LR, and
    # RL's warm-up ramps to its own peak.
    assert policy[5] == pytest.approx(1e-4 / 3, rel=1e-12) and policy[5] < policy[6] < policy[7] == 1e-4
    assert policy[:3] == pytest.approx([1.5e-3, 3e-3, 3e-3], rel=1e-12)  # the warm start's ramp and peak
    assert [m["lr/policy"] for m in _metrics(tmp_path)] == policy
    assert [m["lr/draft"] for m in _metrics(tmp_path)] == draft


def test_a_resumed_job_runs_its_first_update_at_its_own_schedule(tmp_path):
    """A warm start saved by a job of another length (``bench_recipes.py``'s: one RL step) and
    resumed with ``training.steps`` 5: the first RL update runs at this job's warm-up value,
    not at the LR the saving job's schedule left in the checkpointed optimizer."""
    saving = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
              "--task.sft_steps", "2", "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "3",
              "--draft.lr", "5e-4")
    _trainer(tmp_path / "saved", *saving, "--training.steps", "1").run()
    shutil.copytree(tmp_path / "saved" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    trainer = _trainer(tmp_path / "resumed", *saving, "--training.steps", "5")
    policy, draft = _record_lrs(trainer.policy_opt), _record_lrs(trainer.draft_opt)
    trainer.run()
    rl = dict(steps=5, warmup=3, decay="linear", min_factor=0.667)
    assert policy == pytest.approx([1e-4 * _factor(i, **rl) for i in range(5)], rel=1e-12, abs=0)
    assert draft == pytest.approx([5e-4 * _factor(i, **rl) for i in range(5)], rel=1e-12, abs=0)
    assert [m["lr/policy"] for m in _metrics(tmp_path / "resumed")] == policy


@pytest.mark.parametrize("overrides, speculative", [
    (("--draft.no-enable",), False),  # plain RL: rollout.speculative (on by default) is ignored, with a note
    (("--draft.no-enable", "--rollout.no-speculative"), False),
    (("--rollout.no-speculative", "--rollout.draft_tokens", "0"), False),  # the draft trains, decoding is plain
    ((), True),
], ids=["no-draft", "no-draft-no-speculative", "draft-plain-decoding", "draft-speculative"])
def test_every_runnable_draft_and_decoding_combination_runs(tmp_path, capsys, overrides, speculative):
    trainer = _trainer(tmp_path, "--task.sft_steps", "1", "--training.steps", "2", *overrides)
    trainer.run()
    drafted = "--draft.no-enable" not in overrides
    assert trainer.engine.max_draft_tokens == (3 if speculative else 0)
    metrics = _metrics(tmp_path)
    assert [m["phase"] for m in metrics] == ["sft", "rl", "rl"]
    for m in metrics[1:]:
        assert ("loss/draft" in m) == drafted
        if not speculative:
            assert m["rollout/acceptance_length"] == 1.0
    note = "[rollout] speculative ignored" in capsys.readouterr().out
    assert note == (overrides == ("--draft.no-enable",))
    assert (tmp_path / "export" / "draft").exists() == drafted
    if drafted:
        # The exported draft places positions as the policy does, as far as the policy reaches.
        draft_cfg, policy_cfg = (json.loads((tmp_path / "export" / part / "config.json").read_text())
                                 for part in ("draft", "policy"))
        assert draft_cfg["rope_theta"] == policy_cfg["rope_theta"]
        assert draft_cfg.get("rope_scaling") == policy_cfg.get("rope_scaling")
        assert draft_cfg["max_position_embeddings"] >= policy_cfg["max_position_embeddings"]


def _policy_folder(folder: Path, policy=None) -> Path:
    """``policy`` (default: the debug config's, freshly initialised) saved as a Hugging Face
    folder with the project's tokenizer files."""
    from titan_cotrain.models.build import build_target
    from titan_cotrain.models.hf import save_hf

    save_hf(policy if policy is not None else build_target(load_job_config([], world_size=1)), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tokenizer" / name, folder / name)
    return folder


def _chosen_ids(draft) -> list[int]:
    return (torch.arange(draft.args.draft_vocab_size) + draft.d2t.cpu()).tolist()


def _top(counts: Counter, k: int, vocab: int) -> list[int]:
    return sorted(sorted(range(vocab), key=lambda t: (-counts[t], t))[:k])


def test_a_reduced_draft_vocabulary_is_counted_on_task_samples(tmp_path):
    """Through the task protocol: the stream's first ``vocab_samples`` prompts + demonstrations,
    as tokenized for the warm start; a vocabulary larger than twice what the task writes is refused."""
    trainer = _trainer(tmp_path, "--draft.vocab_size", "12", "--draft.vocab_samples", "50")
    counts = Counter()
    for position in range(50):  # the prompt stream's first problems, each drawn from its position's stream
        rng = random.Random(f"{trainer.seed}/position/{position}")
        problem = trainer.task.sample(rng, position)
        counts.update(trainer.tokenizer.encode(problem.prompt, add_bos=True, add_eos=False))
        counts.update(trainer.tokenizer.encode(trainer.task.demonstration(problem, rng), add_bos=False, add_eos=True))
    assert _chosen_ids(trainer.draft) == _top(counts, 12, 256) == _chosen_ids(trainer.engine.draft)
    with pytest.raises(ValueError, match=r"\[draft\] vocab_size = 64: the corpus .* holds 1[0-9] distinct tokens"):
        _trainer(tmp_path, "--draft.vocab_size", "64")


def test_a_reduced_draft_vocabulary_can_count_the_policys_own_generations(tmp_path, monkeypatch):
    """``vocab_generations``: the initial policy (a Hugging Face folder) answers task prompts at
    construction, and its responses are the corpus (with ``vocab_samples = 0``)."""
    folder = _policy_folder(tmp_path / "policy")
    outputs = []
    generate = RolloutEngine.generate
    monkeypatch.setattr(RolloutEngine, "generate", lambda *a, **k: outputs.append(generate(*a, **k)) or outputs[-1])
    trainer = _trainer(tmp_path / "run", "--model.hf_path", str(folder), "--draft.vocab_size", "16",
                       "--draft.vocab_samples", "0", "--draft.vocab_generations", "4")
    (out,) = outputs
    assert out.tokens.shape[0] == 4
    counts = Counter(t for i, n in enumerate(out.response_lens.tolist()) for t in out.tokens[i, :n].tolist())
    assert _chosen_ids(trainer.draft) == _top(counts, 16, 256) == _chosen_ids(trainer.engine.draft)
    assert trainer.draft.t2d.sum() == 16 and trainer.engine.draft.t2d.sum() == 16


@pytest.mark.parametrize("rope", [
    dict(rope_theta=1e6, rope_scaling=None),
    dict(rope_theta=5e5, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
], ids=["plain-rope", "llama3-scaled-rope"])
def test_the_exported_draft_config_carries_the_policys_rope_and_context(tmp_path, rope):
    """The EAGLE-3 ``config.json`` the job exports: the policy's ``rope_theta`` and
    ``rope_scaling`` (both layouts), and a ``max_position_embeddings`` no smaller than the
    policy's, whatever ``training.seq_len`` the job trains at (64 here)."""
    from titan_cotrain.models.build import build_target
    from titan_cotrain.models.transformer import Transformer

    base = build_target(load_job_config([], world_size=1))
    policy = Transformer(base.args.replace(max_seq_len=4096, **rope), tap_layers=base.tap_layers)
    policy.load_state_dict(base.state_dict())
    folder = _policy_folder(tmp_path / "policy", policy)
    trainer = _trainer(tmp_path / "run", "--model.hf_path", str(folder))
    trainer.export()
    policy_config = json.loads((folder / "config.json").read_text())
    draft_config = json.loads((tmp_path / "run" / "export" / "draft" / "config.json").read_text())
    assert draft_config["rope_theta"] == policy_config["rope_theta"] == rope["rope_theta"]
    assert draft_config["rope_scaling"] == policy_config["rope_scaling"]
    assert draft_config["rope_parameters"] == policy_config["rope_parameters"]
    if rope["rope_scaling"] is not None:
        assert draft_config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert draft_config["max_position_embeddings"] >= policy_config["max_position_embeddings"] == 4096
