"""``python -m titan_cotrain.config.check --world-size N [--job.config_file F] [--section.key value ...]``:
the job config checked in one process, as ``python -m titan_cotrain.train`` on ``N`` ranks
would check it, before a launcher starts them (``scripts/train.sh``): a bad key or value
prints its one message once and exits 2, instead of once per rank followed by the
launcher's own traceback. Exits 0 when the config is valid (printing nothing)."""

import sys

import titan_cotrain  # noqa: F401  (registers every package's config checks)
from titan_cotrain.config.loader import ConfigError, load_job_config

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    world_size = None
    if args and args[0].startswith("--world-size"):
        flag = args.pop(0)
        value = flag.partition("=")[2] or (args.pop(0) if args else "")
        if not value.isdigit() or int(value) < 1:
            print(f"config check: --world-size needs a positive integer, got {value!r}", file=sys.stderr)
            return 2
        world_size = int(value)
    try:
        load_job_config(args, world_size=world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
