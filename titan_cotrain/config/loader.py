"""Load, override and validate a job config; every mistake is one ``ConfigError``.

Order: read the TOML (tomli) -> reject unknown sections/keys and wrong value types,
naming the key and the file -> torchtitan's ``ConfigManager`` merges our sections
(``custom_config_module``) and applies ``--section.key value`` overrides (tyro syntax:
booleans are flags, ``--compile.enable`` / ``--compile.no-enable``; lists are space
separated) -> cross-field checks against the world size and the model's shape.
"""

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli

from titan_cotrain.components import titan
from titan_cotrain.config import job_config as ours

CUSTOM_CONFIG_MODULE = ours.__name__
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "debug_cpu.toml"


class ConfigError(ValueError):
    """A bad job config. The message names the key and where it came from."""


def _section_types() -> dict[str, dict[str, Any]]:
    """``{section: {key: type}}`` of torchtitan's JobConfig merged with ours (ours wins)."""
    merged: dict[str, dict[str, Any]] = {}
    for root in (titan.titan_job_config_class(), ours.JobConfig):
        for section in dataclasses.fields(root):
            merged.setdefault(section.name, {}).update(typing.get_type_hints(section.type))
    return merged


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1])
                                               for k, v in value.items()) if args else isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _check_table(table: dict, types_by_key: dict[str, Any], where: str, source: str, errors: list[str]) -> None:
    for key, value in table.items():
        if key not in types_by_key:
            close = difflib.get_close_matches(key, list(types_by_key), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{source}: unknown key {where}.{key}{hint}")
            continue
        tp = types_by_key[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            _check_table(value, typing.get_type_hints(tp), f"{where}.{key}", source, errors)
        elif not _matches(value, tp):
            errors.append(f"{source}: {where}.{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def check_toml(raw: dict, source: str) -> None:
    """Unknown sections/keys and wrong types in a parsed TOML document."""
    sections = _section_types()
    errors: list[str] = []
    for name, table in raw.items():
        if name not in sections:
            close = difflib.get_close_matches(name, list(sections), n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            errors.append(f"{source}: unknown section [{name}]{hint}")
        elif not isinstance(table, dict):
            errors.append(f"{source}: [{name}] must be a table, got {table!r}")
        else:
            _check_table(table, sections[name], name, source, errors)
    module = raw.get("job", {}).get("custom_config_module", CUSTOM_CONFIG_MODULE)
    if module not in ("", CUSTOM_CONFIG_MODULE):
        errors.append(f"{source}: job.custom_config_module must be {CUSTOM_CONFIG_MODULE!r}, got {module!r}")
    if errors:
        raise ConfigError("\n".join(errors))


def _config_file(args: list[str]) -> tuple[list[str], Path]:
    """The ``--job.config_file`` argument (or the embedded default, appended to ``args``)."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError("--job.config_file needs a path")
                value = args[i + 1]
            return args, Path(value)
    return [*args, "--job.config_file", str(DEFAULT_CONFIG)], DEFAULT_CONFIG


def config_file_of(args: list[str]) -> Path:
    """The job file ``args`` name (``--job.config_file``), or the embedded default."""
    return _config_file(list(args))[1]


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _merge_tables(base: dict, top: dict) -> dict:
    """``base`` with ``top``'s keys on top; tables merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in top.items():
        merged[key] = _merge_tables(base[key], value) if isinstance(value, dict) and isinstance(
            base.get(key), dict) else value
    return merged


def read_job_toml(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The job file's values, checked, with the files it ``[job] extends`` merged underneath."""
    raw = read_toml(path)
    check_toml(raw, str(path))
    base = raw.get("job", {}).get("extends")
    if not base:
        return raw
    chain = (*_chain, path.resolve())
    base_path = (path.parent / base).resolve()
    if base_path in chain:
        raise ConfigError(f"{path}: job.extends = {base!r} makes a cycle: "
                          + " -> ".join(str(p) for p in (*chain, base_path)))
    if not base_path.is_file():
        raise ConfigError(f"{path}: job.extends = {base!r}: no such file {base_path}")
    try:
        base_values = read_job_toml(base_path, chain)
    except ConfigError as e:
        raise ConfigError(f"{e}\n  (read because {path} has job.extends = {base!r})") from None
    return _merge_tables(base_values, raw)


def load_job_config(args: list[str] | None = None, world_size: int | None = None):
    """Parse ``args`` (``--job.config_file F`` plus overrides) into a validated JobConfig.

    ``world_size`` defaults to the ``WORLD_SIZE`` environment variable (1 when unset), or,
    for a config with ``[simulate] enable`` (in the file or on the command line), to
    ``"config"``: the product of the config's parallel degrees (the simulator's world).
    Raises ``ConfigError`` for anything wrong; tyro exits with its own message for a
    malformed command-line override.
    """
    args, path = _config_file(list(args or []))
    raw = read_job_toml(path)
    if not raw.get("job", {}).get("custom_config_module"):
        args = [*args, "--job.custom_config_module", CUSTOM_CONFIG_MODULE]
    config = titan.parse_job_config(raw, args)
    if world_size is None and config.simulate.enable:
        world_size = "config"
    if world_size == "config":  # the simulator: the world the config's degrees describe
        p = config.parallelism
        world_size = (p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1)
                      * p.context_parallel_degree * p.pipeline_parallel_degree)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from titan_cotrain.config.validate import validate_job_config

    validate_job_config(config, world_size, source=str(path))
    return config
