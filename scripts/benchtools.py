"""Shared by the benchmark scripts: matplotlib (the project's optional ``bench`` extra) on the
file-only Agg backend, since the benchmarks run on headless machines and only write PNGs;
and the command line a result was made with, for its JSON."""

import functools
import shlex
import sys


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError as error:  # plots are optional: the measurements do not need them
        raise SystemExit("the benchmark plots need matplotlib: pip install -e .[bench]") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def optional_plot(plot):
    """``plot`` left out, with a note, where matplotlib is not installed: an offline GPU node
    (``scripts/gpu_check.sh --wheels``) has no room for it, and the measurements are in the
    JSON, which ``--replot`` draws on another machine."""

    @functools.wraps(plot)
    def plot_if_possible(*args, **kwargs):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"no matplotlib here: {plot.__name__} left out (the numbers are in the JSON)", file=sys.stderr)
            return None
        return plot(*args, **kwargs)

    return plot_if_possible


def save_figure(fig, path) -> None:
    """Lay ``fig`` out, write it to ``path`` (its folder made) and close it."""
    from matplotlib import pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plain_ticks(axis) -> None:
    """Log-axis tick labels as plain numbers (``64``, not ``2^6``): readable values."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))


def command_line(argv: list[str] | None = None) -> str:
    """``python scripts/<name>.py <flags>`` as this process was started, without the output
    paths (``--json``, ``--png``, ``--work``, ``--out`` and their values): the settings that
    made the numbers."""
    argv = list(sys.argv if argv is None else argv)
    script, flags, kept = argv[0], argv[1:], []
    skip = False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("--json", "--png", "--work", "--out"):
            skip = True
        elif not flag.startswith(("--json=", "--png=", "--work=", "--out=")):
            kept.append(flag)
    name = script.replace("\\", "/").rsplit("/", 1)[-1]
    return shlex.join(["python", f"scripts/{name}", *kept])
