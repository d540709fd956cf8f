"""The recipe's settings and torchtitan's keys at start: combinations that make no sense, and
torchtitan keys the job does not honour, are refused with one message naming the key."""

import dataclasses
import types
import typing
from pathlib import Path

import pytest

from titan_cotrain.components import titan
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.config.torchtitan_keys import UNHONOURED

REPO = Path(__file__).resolve().parents[2]


def _load(*overrides: str):
    return load_job_config(list(overrides), world_size=2)


def _refused(*overrides: str, needle: str) -> str:
    with pytest.raises(ConfigError) as e:
        _load(*overrides)
    assert needle in str(e.value), str(e.value)
    return str(e.value)


def test_the_recipe_keys_default_to_todays_recipe():
    rl = _load().rl
    assert (rl.loss_aggregation, rl.normalize_std, rl.advantage, rl.ratio_level, rl.overlong, rl.dynamic_sampling) == \
        ("token_mean", True, "grpo", "token", "none", False)


@pytest.mark.parametrize("overrides,needle", [
    (("--rl.ratio_level", "sequence"), 'needs rl.loss_aggregation = "seq_mean_token_mean"'),
    (("--rl.ratio_level", "sequence", "--rl.loss_aggregation", "seq_mean_token_mean", "--rl.tis_cap", "2"),
     "set rl.tis_cap = 0"),
    (("--rl.ratio_level", "sequence", "--rl.loss_aggregation", "seq_mean_token_mean", "--rl.updates_per_step", "2"),
     "rl.updates_per_step = 1"),
    (("--rl.overlong", "soft"), "rl.overlong_buffer"),
    (("--rl.overlong", "soft", "--rl.overlong_buffer", "1000"), "must be in [1, rollout.max_new_tokens"),
    (("--rl.overlong_buffer", "4"), 'read only with rl.overlong = "soft"'),
    (("--rl.dynamic_sampling_max_rounds", "-1"), "dynamic_sampling_max_rounds must be >= 0"),
    (("--rl.loss_aggregation", "mean"), "loss_aggregation"),
])
def test_recipe_combinations_that_make_no_sense_are_refused(overrides, needle):
    with pytest.raises((ConfigError, SystemExit)) as e:
        _load(*overrides)
    if e.type is ConfigError:
        assert needle in str(e.value), str(e.value)


def test_sensible_recipes_load():
    gspo = _load("--rl.ratio_level", "sequence", "--rl.loss_aggregation", "seq_mean_token_mean",
                 "--rl.clip_eps_low", "3e-4", "--rl.clip_eps_high", "4e-4")
    assert gspo.rl.ratio_level == "sequence"
    dapo = _load("--rl.overlong", "soft", "--rl.overlong_buffer", "8", "--rl.clip_eps_high", "0.28")
    assert dapo.rl.overlong_buffer == 8
    dr_grpo = _load("--rl.no-normalize_std", "--rl.loss_aggregation", "seq_mean_token_sum_norm")
    assert not dr_grpo.rl.normalize_std


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _other_value(tp, default):
    """A value of type ``tp`` that is not ``default``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return next(a for a in args if a != default)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in args if a is not type(None))
        origin = typing.get_origin(tp)
    if tp is bool:
        return not default
    if tp is int:
        return (default or 0) + 3
    if tp is float:
        return (default or 0.0) + 3.5
    if tp is str:
        return "something"
    if origin is list or tp is list:
        return ["x"]
    raise AssertionError(f"no test value for {tp}")


@pytest.mark.parametrize("dotted", sorted(UNHONOURED))
def test_every_unhonoured_torchtitan_key_is_refused_when_set(dotted, tmp_path):
    """A job file that sets the key to something other than torchtitan's default fails with
    the key and what to use instead in the message."""
    section, key = dotted.split(".")
    root = titan.titan_job_config_class()
    section_type = typing.get_type_hints(root)[section]
    tp = typing.get_type_hints(section_type)[key]
    default = getattr(section_type(), key)
    base = f'extends = "{REPO / "train_configs" / "debug_cpu.toml"}"\n'
    table, name = f"{section}", key
    while dataclasses.is_dataclass(tp):  # a table: change its first key
        table, inner = f"{table}.{name}", dataclasses.fields(tp)[0]
        tp, default, name = typing.get_type_hints(tp)[inner.name], getattr(default, inner.name), inner.name
    body = f"[{table}]\n{name} = {_toml(_other_value(tp, default))}\n"
    job = tmp_path / "job.toml"
    if section == "job":
        job.write_text(body + base)
    else:
        job.write_text(f"[job]\n{base}\n{body}")
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(job)], world_size=2)
    message = str(e.value)
    assert f"{dotted} = " in message and "does not honour" in message and UNHONOURED[dotted] in message, message


def test_every_torchtitan_key_is_refused_or_read():
    """Each key of torchtitan's JobConfig that the project's sections do not redefine is
    either in ``UNHONOURED`` or read somewhere in the package (by name): a torchtitan key
    added or forgotten fails here."""
    from titan_cotrain.config import job_config as ours

    own = {f.name: {g.name for g in dataclasses.fields(f.type)} for f in dataclasses.fields(ours.JobConfig)}
    package = REPO / "titan_cotrain"
    sources = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name not in ("torchtitan_keys.py",
                                                                                       "job_config.py"))
    # Keys torchtitan's own builders read from the section the project hands them whole.
    whole_sections = {"optimizer", "checkpoint", "comm", "lr_scheduler"}
    labels = {"job.description"}  # changes nothing by design
    missing = []
    for section in dataclasses.fields(titan.titan_job_config_class()):
        for field in dataclasses.fields(section.type):
            dotted = f"{section.name}.{field.name}"
            if (field.name in own.get(section.name, set()) or dotted in UNHONOURED or dotted in labels
                    or section.name in whole_sections):
                continue
            if f".{field.name}" not in sources and f'"{field.name}"' not in sources:
                missing.append(dotted)
    assert not missing, f"torchtitan keys neither read nor refused: {missing}"


def test_a_set_but_default_valued_key_is_accepted(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nextends = "{REPO / "train_configs" / "debug_cpu.toml"}"\n\n'
                   "[metrics]\nenable_wandb = false\n[validation]\nenable = false\n")
    assert not load_job_config(["--job.config_file", str(job)], world_size=2).metrics.enable_wandb
