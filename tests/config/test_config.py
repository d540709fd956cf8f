"""Every bad config gives one ConfigError that names the key and the file."""

from dataclasses import asdict
from pathlib import Path

import pytest

from titan_cotrain.config import ConfigError, load_job_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "train_configs" / "debug_cpu.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _load(path: Path, *overrides: str, world_size: int = 1):
    return load_job_config(["--job.config_file", str(path), *overrides], world_size=world_size)


def test_default_config_loads_with_our_sections():
    import tomli

    raw = tomli.loads(DEFAULT.read_text())
    config = load_job_config([], world_size=2)  # no --job.config_file: the embedded default
    assert config.model.name == raw["model"]["name"]
    assert config.draft.ttt_steps == raw["draft"]["ttt_steps"]
    assert config.rl.group_size == raw["rl"]["group_size"]
    assert config.task.sft_lr == raw["task"]["sft_lr"]
    assert config.optimizer.lr == raw["optimizer"]["lr"]  # torchtitan's own sections are there too
    assert config.draft.lr == raw["draft"]["lr"]


def test_cli_overrides_take_precedence():
    config = _load(DEFAULT, "--draft.ttt_steps", "5", "--draft.freeze_after_sft", "--draft.tap_layers", "1", "2", "5",
                   world_size=2)
    assert config.draft.ttt_steps == 5
    assert config.draft.freeze_after_sft is True
    assert config.draft.tap_layers == [1, 2, 5]


@pytest.mark.parametrize("sample", sorted((REPO / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_reads(sample):
    from titan_cotrain.config.loader import check_toml, read_toml

    check_toml(read_toml(sample), str(sample))


def test_a_job_extends_another(tmp_path):
    base = _write(tmp_path,
                  '[job]\ndescription = "base"\n[rl]\ngroup_size = 4\nkl_coef = 2e-4\n[draft]\nttt_steps = 5\n')
    middle = tmp_path / "sub" / "middle.toml"
    middle.parent.mkdir()
    middle.write_text('[job]\nextends = "../job.toml"\n[rl]\nkl_coef = 7e-4\n')
    top = tmp_path / "sub" / "top.toml"
    top.write_text('[job]\nextends = "middle.toml"\ndescription = "top"\n[draft]\nfreeze_after_sft = true\n')
    config = _load(top, "--draft.ttt_steps", "6")
    assert config.job.description == "top"
    assert (config.rl.group_size, config.rl.kl_coef) == (4, 7e-4)  # a table merges key by key
    assert config.draft.freeze_after_sft is True and config.draft.ttt_steps == 6  # the command line wins
    assert _load(base).job.description == "base"


def test_the_frozen_draft_variant_is_the_default_with_the_draft_frozen():
    frozen = _load(REPO / "train_configs" / "debug_cpu_frozen_draft.toml", world_size=2)
    default = _load(DEFAULT, world_size=2)
    assert frozen.draft.freeze_after_sft and not default.draft.freeze_after_sft
    for section in ("model", "training", "optimizer", "rl", "rollout", "task"):
        assert asdict(getattr(frozen, section)) == asdict(getattr(default, section)), section


def test_extends_errors_name_the_file(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('[job]\nextends = "b.toml"\n')
    b.write_text('[job]\nextends = "a.toml"\n')
    _expect(a, "makes a cycle", "a.toml -> ", "b.toml")
    a.write_text('[job]\nextends = "nowhere.toml"\n')
    _expect(a, "a.toml", "job.extends = 'nowhere.toml'", "no such file")
    b.write_text('[drfat]\nttt_steps = 3\n')
    a.write_text('[job]\nextends = "b.toml"\n')
    _expect(a, "b.toml", "drfat")  # a mistake in the extended file names that file


def _expect(path: Path, *needles: str, overrides=(), world_size: int = 1):
    with pytest.raises(ConfigError) as err:
        _load(path, *overrides, world_size=world_size)
    message = str(err.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message


def test_unknown_section(tmp_path):
    _expect(_write(tmp_path, "[drafts]\nttt_steps = 3\n"), "unknown section [drafts]", "did you mean [draft]")


def test_unknown_key(tmp_path):
    _expect(_write(tmp_path, "[training]\nseq_lenn = 3\n"), "unknown key training.seq_lenn", "seq_len")


def test_wrong_type(tmp_path):
    _expect(_write(tmp_path, '[draft]\nttt_steps = "seven"\n'), "draft.ttt_steps must be int", "'seven'")


def test_wrong_literal(tmp_path):
    _expect(_write(tmp_path, '[draft]\nloss_on = "prompt"\n'), "draft.loss_on must be 'response' | 'all'")


def test_malformed_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[job\n")
    _expect(path, "not valid TOML")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        _load(tmp_path / "nope.toml")


def test_parallel_degrees_must_multiply_to_world_size():
    _expect(DEFAULT, "world size is 4", "context_parallel_degree",
            overrides=("--parallelism.data_parallel_shard_degree", "3"), world_size=4)


def test_a_simulated_job_validates_against_its_own_world(tmp_path, monkeypatch):
    """``[simulate] enable = true`` in the file (not only on the command line): the job is
    checked against the world its degrees describe, not the launch's ``WORLD_SIZE``."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = tmp_path / "sim.toml"
    job.write_text(f'[job]\nextends = "{Path(DEFAULT).resolve()}"\n[parallelism]\ndata_parallel_shard_degree = 8\n'
                   '[simulate]\nenable = true\n')
    config = load_job_config(["--job.config_file", str(job)])
    assert config.simulate.enable and config.parallelism.data_parallel_shard_degree == 8
    with pytest.raises(ConfigError, match="world size is 1"):  # the same job, not simulated
        load_job_config(["--job.config_file", str(job), "--simulate.no-enable"])


def test_shard_degree_cannot_be_inferred():
    _expect(DEFAULT, "world size 3 is not divisible", overrides=("--parallelism.context_parallel_degree", "2"),
            world_size=3)


def test_seq_len_must_split_into_zigzag_chunks():
    _expect(DEFAULT, "training.seq_len (100) must be divisible by 2 x context_parallel_degree = 8",
            overrides=("--parallelism.context_parallel_degree", "4", "--training.seq_len", "100"), world_size=4)


def test_tap_layers_out_of_range():
    _expect(DEFAULT, "draft.tap_layers", "out of range", "8-layer", overrides=("--draft.tap_layers", "1", "3", "8"))


def test_tap_layers_must_be_distinct():
    _expect(DEFAULT, "draft.tap_layers", "distinct", overrides=("--draft.tap_layers", "3", "3"))


def test_unknown_architecture():
    _expect(DEFAULT, "model.name", "unknown architecture 'gpt2'", "llama3, qwen3", overrides=("--model.name", "gpt2"))


def test_unknown_flavor():
    _expect(DEFAULT, "model.flavor", "unknown flavor '405B'", overrides=("--model.flavor", "405B"))


def test_a_flavor_cut_to_a_few_layers(tmp_path):
    """``[model] n_layers``: the flavor's widths at fewer layers (the 8-GPU smoke test's
    real-scale configs); the default taps need 7 layers, so a 4-layer cut names its own."""
    from titan_cotrain.models.build import resolve_model_args
    from titan_cotrain.models.args import model_args_for

    config = _load(REPO / "train_configs" / "qwen3_8b_fsdp_cp.toml", "--model.n_layers", "4",
                   "--draft.tap_layers", "0", "1", "2", "--task.name", "arithmetic", "--draft.vocab_size", "0",
                   world_size=8)
    assert resolve_model_args(config) == model_args_for("qwen3", "8B").replace(n_layers=4)
    _expect(DEFAULT, "draft.tap_layers", "distinct", overrides=("--model.n_layers", "4"))
    _expect(DEFAULT, "model.n_layers", "without model.hf_path",
            overrides=("--model.n_layers", "4", "--model.hf_path", str(tmp_path)))


def test_missing_hf_folder(tmp_path):
    _expect(DEFAULT, "model.hf_path", "no such directory", overrides=("--model.hf_path", str(tmp_path / "none")))


def test_ranges_are_checked():
    _expect(DEFAULT, "draft.pass_decay must be in (0, 1]", "rl.group_size must be >= 2",
            overrides=("--draft.pass_decay", "1.5", "--rl.group_size", "1"))
    _expect(DEFAULT, "rollout.acceptance_warning_fraction must be in [0, 1]",
            "rollout.acceptance_warning_steps must be >= 1",
            overrides=("--rollout.acceptance_warning_fraction", "1.5", "--rollout.acceptance_warning_steps", "0"))
    _expect(DEFAULT, "rollout.collapse_fraction must be in [0, 1)", "rollout.collapse_position_rate must be in [0, 1)",
            "rollout.collapse_steps must be >= 1",
            overrides=("--rollout.collapse_fraction", "1.0", "--rollout.collapse_position_rate", "-0.1",
                       "--rollout.collapse_steps", "0"))
    _expect(DEFAULT, "rollout.speculation_granularity must be 'round' or 'call'",
            overrides=("--rollout.speculation_granularity", "token"))


def test_tensor_parallel_is_refused():
    _expect(DEFAULT, "tensor parallelism is not supported", overrides=("--parallelism.tensor_parallel_degree", "2"),
            world_size=2)


def test_expert_parallel_degree_is_checked():
    moe = ("--model.name", "qwen3", "--model.flavor", "debugmoe")

    def ep(degree: int, *others: str) -> tuple[str, ...]:
        return (*moe, "--parallelism.expert_parallel_degree", str(degree), *others)

    assert _load(DEFAULT, *ep(2), world_size=2).parallelism.expert_parallel_degree == 2
    _expect(DEFAULT, "parallelism.expert_parallel_degree must be >= 1", overrides=ep(0))
    _expect(DEFAULT, "parallelism.expert_parallel_degree (2): the policy (llama3 debugmodel) is dense",
            overrides=("--parallelism.expert_parallel_degree", "2"), world_size=2)
    _expect(DEFAULT, "parallelism.expert_parallel_degree (3) must divide the policy's 8 experts", overrides=ep(3),
            world_size=3)
    _expect(DEFAULT, "parallelism.expert_parallel_degree (4) must divide data_parallel_shard_degree x "
            "context_parallel_degree = 1 x 2", overrides=ep(4, "--parallelism.data_parallel_replicate_degree", "2",
                                                            "--parallelism.context_parallel_degree", "2"),
            world_size=4)
    # Under PP, each PP coordinate's data-parallel ranks hold the ep groups.
    pp_ep = _load(DEFAULT, *ep(2, "--parallelism.pipeline_parallel_degree", "2"), world_size=4).parallelism
    assert (pp_ep.pipeline_parallel_degree, pp_ep.expert_parallel_degree) == (2, 2)
    _expect(DEFAULT, "parallelism.expert_parallel_degree (4) must divide data_parallel_shard_degree x "
            "context_parallel_degree = 2 x 1", overrides=ep(4, "--parallelism.pipeline_parallel_degree", "2"),
            world_size=4)
    _expect(DEFAULT, "parallelism.expert_parallel_degree (2) with a compiled policy is not built yet",
            overrides=ep(2, "--compile.enable"), world_size=2)


def test_an_engine_tensor_parallel_degree_must_divide_the_peers_and_the_heads():
    _expect(DEFAULT, "rollout.tensor_parallel_degree (2) must divide context_parallel_degree x "
            "pipeline_parallel_degree = 1", overrides=("--rollout.tensor_parallel_degree", "2"), world_size=2)
    qwen3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel")  # 4 heads, 2 KV heads
    _expect(DEFAULT, "rollout.tensor_parallel_degree (8) must divide the policy's heads (4)",
            overrides=("--rollout.tensor_parallel_degree", "8", "--parallelism.context_parallel_degree", "8",
                       "--simulate.gpus_per_node", "8", *qwen3), world_size=8)
    # More engine ranks than KV heads: each KV head is computed on two of them.
    assert _load(DEFAULT, "--rollout.tensor_parallel_degree", "4", "--parallelism.context_parallel_degree", "4",
                 *qwen3, world_size=4).rollout.tensor_parallel_degree == 4


def test_truncated_importance_sampling_needs_one_update_per_step():
    _expect(DEFAULT, "rl.tis_cap needs rl.updates_per_step = 1 (got 2)",
            overrides=("--rl.tis_cap", "2", "--rl.updates_per_step", "2"))
    _expect(DEFAULT, "rl.tis_cap", "0 (off) or >= 1", overrides=("--rl.tis_cap", "0.5"))


def test_foreign_custom_config_module(tmp_path):
    _expect(_write(tmp_path, '[job]\ncustom_config_module = "somewhere.else"\n'), "job.custom_config_module")


def test_unknown_task():
    _expect(DEFAULT, "task.name", "unknown task 'chess'", "arithmetic, arithmetic_longtail, custom, gsm8k, math, sort",
            overrides=("--task.name", "chess"))


def test_dataset_task_keys(tmp_path):
    _expect(DEFAULT, "task.dataset_path: task 'math' reads its prompts from a local JSONL or Parquet file",
            overrides=("--task.name", "math"))
    missing = str(tmp_path / "train.jsonl")
    _expect(DEFAULT, f"task.dataset_path = {missing!r}: no such file",
            overrides=("--task.name", "gsm8k", "--task.dataset_path", missing))
    (tmp_path / "train.csv").write_text("question,answer\n")
    _expect(DEFAULT, "extension '.csv'", "set task.dataset_format",
            overrides=("--task.name", "math", "--task.dataset_path", str(tmp_path / "train.csv")))
    _expect(DEFAULT, "task.eval_size (3) and task.eval_fraction (0.1): set one of them",
            overrides=("--task.name", "math", "--task.dataset_path", str(tmp_path / "train.csv"),
                       "--task.dataset_format", "json", "--task.eval_size", "3", "--task.eval_fraction", "0.1"))
    config = _load(DEFAULT, "--task.name", "math", "--task.dataset_path", str(tmp_path / "train.csv"),
                   "--task.dataset_format", "json")
    assert (config.task.dataset_format, config.task.prompt_field, config.task.answer_field) == \
        ("json", "question", "answer")
    # The scale simulator never reads the file: it need not exist.
    simulated = _load(DEFAULT, "--task.name", "math", "--task.dataset_path", missing, "--simulate.enable")
    assert simulated.task.name == "math"


@pytest.mark.parametrize("name, world_size", [("qwen3_8b_fsdp_cp.toml", 8), ("qwen3_30b_a3b_fsdp.toml", 8),
                                              ("qwen3_30b_a3b_pp_cp.toml", 16), ("qwen3_32b_pp_cp.toml", 16),
                                              ("qwen3_235b_a22b_fsdp_cp.toml", 64)])
def test_real_scale_samples_validate_at_their_world_size(name, world_size, tmp_path):
    # Their dataset_path is a placeholder for a local file; validation insists on one.
    _expect(REPO / "train_configs" / name, "task.dataset_path = '/data/", "no such file", world_size=world_size)
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "answer": "1"}\n')
    config = _load(REPO / "train_configs" / name, "--task.dataset_path", str(data), world_size=world_size)
    p = config.parallelism
    assert p.data_parallel_shard_degree * p.context_parallel_degree * p.pipeline_parallel_degree == world_size
    assert config.task.name in ("gsm8k", "math")
    _expect(REPO / "train_configs" / name, "but the world size is", world_size=world_size // 2)


def test_unsupported_compile_and_checkpointing_modes(tmp_path):
    _expect(DEFAULT, "compile.components: unknown ['engine']", "rollout.compile",
            overrides=("--compile.enable", "--compile.components", "model,engine"))
    _expect(_write(tmp_path, '[activation_checkpoint]\nmode = "selective"\n'),
            "activation_checkpoint.mode must be 'full' | 'none'")


def test_draft_combinations_that_cannot_run_are_refused_naming_the_key(tmp_path):
    # Speculative decoding that drafts nothing: plain decoding is --rollout.no-speculative.
    _expect(DEFAULT, "rollout.draft_tokens = 0", "--rollout.no-speculative", overrides=("--rollout.draft_tokens", "0"))
    # Freezing a draft that is not there.
    _expect(DEFAULT, "draft.freeze_after_sft", "draft.enable is false",
            overrides=("--draft.no-enable", "--draft.freeze_after_sft"))
    # Counting generations needs a trained policy and a reduced vocabulary of the job's own.
    _expect(DEFAULT, "draft.vocab_generations", "model.hf_path", "a reduced draft.vocab_size",
            overrides=("--draft.vocab_generations", "8"))
    _expect(DEFAULT, "draft.vocab_generations", "no draft.init_path",
            overrides=("--draft.vocab_generations", "8", "--draft.vocab_size", "16",
                       "--draft.init_path", str(tmp_path)))
    _expect(DEFAULT, "task.sft_min_lr_factor must be in [0, 1]", overrides=("--task.sft_min_lr_factor", "2"))


def test_draft_combinations_that_run_are_accepted():
    for overrides in (("--draft.no-enable",), ("--draft.no-enable", "--rollout.no-speculative"),
                      ("--rollout.no-speculative", "--rollout.draft_tokens", "0"),
                      ("--draft.freeze_after_sft", "--rollout.no-speculative")):
        _load(DEFAULT, *overrides)


def test_an_engine_group_larger_than_a_node_is_refused(tmp_path, monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE bounds [rollout] tensor_parallel_degree: a larger engine
    group would all-reduce across nodes twice per layer and step."""
    path = _write(tmp_path, "[parallelism]\ncontext_parallel_degree = 2\n[rollout]\ntensor_parallel_degree = 2\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _expect(path, "rollout.tensor_parallel_degree (2) exceeds the 1 processes of a node", world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _load(path, world_size=2).rollout.tensor_parallel_degree == 2
