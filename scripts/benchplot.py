"""matplotlib for the benchmark scripts (the project's optional ``bench`` extra), on the
file-only Agg backend: the benchmarks run on headless machines and only write PNGs."""


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError as error:  # plots are optional: the measurements do not need them
        raise SystemExit("the benchmark plots need matplotlib: pip install -e .[bench]") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_ticks(axis) -> None:
    """Log-axis tick labels as plain numbers (``64``, not ``2^6``): readable values."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
