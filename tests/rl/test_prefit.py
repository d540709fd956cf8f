"""The draft's prefit (``[draft] prefit_steps``): draft-only steps on the policy's own plain
generations between the warm start and RL. The policy comes out bitwise untouched; the draft
trains; the prefit asks RL's first prompts; under CP, PP and FSDP it trains as one process
does; a resume inside it repeats the uninterrupted run exactly."""

import shutil

import pytest
import torch

from tests.test_train import LEADER_GENERATES, REPO, SHORT, _assert_repeated_exactly, _metrics, _run
from titan_cotrain.config import ConfigError, load_job_config

CONFIG = ("--job.config_file", str(REPO / "train_configs" / "debug_cpu.toml"))
PREFIT = ("--task.sft_steps", "1", "--draft.prefit_steps", "2", "--training.steps", "1")


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _optimizer_state(optimizers) -> dict:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in _flatten(optimizers.state_dict()).items()}


def _flatten(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix: tree}


def test_the_prefit_trains_the_draft_alone_on_the_policys_plain_generations(tmp_path):
    from titan_cotrain.rl.trainer import Trainer

    config = load_job_config([*CONFIG, *SHORT, *PREFIT, "--job.dump_folder", str(tmp_path), "--checkpoint.no-enable",
                              "--metrics.no-enable_tensorboard", "--rollout.temperature", "0"], world_size=1)
    trainer = Trainer(config, world_size=1, rank=0)
    assert (trainer.rl_offset, trainer.total_steps) == (3, 4)
    trainer.total_steps = 1  # the warm start only: the policy's optimizer then has a state to keep
    trainer.run()
    policy, draft, optimizer = _state(trainer.policy), _state(trainer.draft), _optimizer_state(trainer.policy_opt)
    assert any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in optimizer.values())
    policy_lr = trainer.policy_lr.schedulers[0].last_epoch

    # Prefit step 1 asks RL's first prompts (prefit_prompts defaults to rl.prompts_per_step);
    # its responses are the engine's plain greedy ones.
    assert trainer.prefit.prompts(2) == trainer.rollouts.prompts(4)[1]
    trainer.refresh_engine()
    plain = trainer.engine.generate(trainer.prefit.prompts(2), trainer.prefit.sampling_params(), samples_per_prompt=1,
                                    draft_tokens=0)
    samples, metrics = trainer.prefit(2)
    assert [s.response for s in samples] == [plain.tokens[i, :n].tolist() for i, n in
                                            enumerate(plain.response_lens.tolist())]
    assert metrics["prefit/responses"] == 2 and metrics["prefit/response_len"] > 0

    trainer.total_steps = 3  # the two prefit steps
    trainer.run()
    assert trainer.state.step == 3
    after = _state(trainer.policy)
    assert all(torch.equal(policy[k], after[k]) for k in policy), "the prefit moved the policy"
    again = _optimizer_state(trainer.policy_opt)
    assert again.keys() == optimizer.keys()
    assert all(torch.equal(v, again[k]) if isinstance(v, torch.Tensor) else v == again[k] for k, v in optimizer.items())
    assert trainer.policy_lr.schedulers[0].last_epoch == policy_lr  # its schedule waits for RL
    trained = _state(trainer.draft)
    assert any(not torch.equal(draft[k], trained[k]) for k in draft), "the prefit did not train the draft"


def test_the_prefits_first_generations_choose_the_reduced_vocabulary_and_are_trained_on(tmp_path, monkeypatch):
    """A fresh draft with a reduced vocabulary on a Hugging Face policy, prefit from step 1: the
    prefit's first step is generated while the trainer is built, its responses are the
    vocabulary's corpus (``vocab_samples = 0``), and that step trains on them without generating
    again: one generation in all."""
    from collections import Counter

    from tests.rl.test_trainer_setup import _chosen_ids, _policy_folder, _top
    from titan_cotrain.engine.rollout import RolloutEngine
    from titan_cotrain.rl.trainer import Trainer

    folder = _policy_folder(tmp_path / "policy")
    calls = []
    generate = RolloutEngine.generate
    monkeypatch.setattr(RolloutEngine, "generate", lambda *a, **k: calls.append(generate(*a, **k)) or calls[-1])
    config = load_job_config([*CONFIG, *SHORT, "--task.sft_steps", "0", "--draft.prefit_steps", "2",
                              "--model.hf_path", str(folder), "--draft.vocab_size", "16", "--draft.vocab_samples", "0",
                              "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.no-enable",
                              "--metrics.no-enable_tensorboard"], world_size=1)
    trainer = Trainer(config, world_size=1, rank=0)
    (out,) = calls
    responses = [out.tokens[i, :n].tolist() for i, n in enumerate(out.response_lens.tolist())]
    counts = Counter(t for r in responses for t in r)
    vocab = trainer.policy.args.vocab_size
    assert _chosen_ids(trainer.draft) == _top(counts, 16, vocab) == _chosen_ids(trainer.engine.draft)
    samples, _ = trainer.prefit(1)
    assert [s.response for s in samples] == responses and len(calls) == 1  # trained on, not generated again
    trainer.prefit(2)
    assert len(calls) == 2


def test_the_draft_schedule_has_the_prefits_phase_and_the_policys_does_not():
    from titan_cotrain.components import titan
    from titan_cotrain.rl.prefit import with_prefit_phase
    from titan_cotrain.rl.trainer_setup import lr_phases

    config = load_job_config([*CONFIG, "--task.sft_steps", "2", "--draft.prefit_steps", "3", "--draft.prefit_lr",
                              "1e-3", "--draft.prefit_warmup_steps", "1", "--lr_scheduler.warmup_steps", "1"],
                             world_size=1)
    phases = with_prefit_phase(config, lr_phases(config, config.draft.sft_lr, config.draft.lr))
    assert [steps for _, steps, _ in phases] == [2, 3, config.training.steps]

    def lrs(phases, steps):
        optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        scheduler, out = titan.build_lr_schedulers([optimizer], phases), []
        for _ in range(steps):
            out.append(scheduler.schedulers[0].get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    with_prefit = lrs(phases, 9)
    without = lrs(lr_phases(config, config.draft.sft_lr, config.draft.lr), 6)
    assert with_prefit[:2] == without[:2]  # the warm start's
    assert max(with_prefit[2:5]) == pytest.approx(1e-3) and with_prefit[4] == pytest.approx(1e-3)  # no decay
    assert with_prefit[5:] == pytest.approx(without[2:])  # RL's, warm-up included, after the prefit


@pytest.mark.parametrize("flags, message", [
    (("--draft.prefit_steps", "2", "--draft.no-enable"), "it needs draft.enable"),
    (("--draft.prefit_steps", "2", "--draft.freeze_after_sft"), "set one of them"),
    (("--draft.prefit_samples", "0"), r"draft\.prefit_samples must be >= 1"),
    (("--draft.prefit_prompts", "3"), r"draft\.prefit_prompts \(3\) must split evenly over the 2 data-parallel"),
])
def test_bad_prefit_settings_are_refused_with_the_key(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config([*CONFIG, *flags], world_size=2)


@pytest.mark.slow
def test_the_prefit_under_cp_pp_and_fsdp_trains_as_one_process_and_resumes_exactly(tmp_path):
    """CP 2 and PP 2 (the first peer generates, as one process does) and FSDP 2 with greedy
    rollouts (the same sequences at any layout: the prompts are drawn by position) train the
    draft as one process: draft loss, accuracy and gradient norm per prefit step within 1e-4.
    Then a 2-process job killed after its first prefit step and resumed repeats the
    uninterrupted one bit for bit."""
    # No warm start: its batch is per data-parallel rank (FSDP 2 would warm-start on twice the demonstrations).
    args = (*SHORT, *PREFIT, "--task.sft_steps", "0", "--checkpoint.no-enable", "--rollout.temperature", "0",
            "--training.local_batch_size", "2", *LEADER_GENERATES)
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    reference = _metrics(tmp_path / "single")
    assert [m["phase"] for m in reference] == ["prefit", "prefit", "rl"]
    assert all(m["loss/policy"] == 0.0 for m in reference[:2])
    for name, layout in (("cp", ("--parallelism.context_parallel_degree", "2")),
                         ("pp", ("--parallelism.pipeline_parallel_degree", "2")), ("fsdp", ())):
        run = _run(*args, *layout, "--job.dump_folder", str(tmp_path / name))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        for a, b in zip(reference, _metrics(tmp_path / name), strict=True):
            for key in ("loss/draft", "grad_norm/draft", "draft/acc_pass1", "prefit/response_len"):
                if key in a:
                    assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (name, a["step"], key, a[key], b[key])

    job = (*SHORT, "--task.sft_steps", "1", "--draft.prefit_steps", "3", "--training.steps", "1",
           "--checkpoint.interval", "1")
    whole = _run(*job, "--job.dump_folder", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    again = _run(*job, "--job.dump_folder", str(resumed))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from step 2" in again.stdout
    _assert_repeated_exactly(_metrics(tmp_path / "whole")[2:], _metrics(resumed))
