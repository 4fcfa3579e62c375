"""Figure helpers every plots module shares (and the sweep report): a Figure on an Agg canvas, PNG bytes that are
the same for the same figure, a figure embedded in an HTML report, value labels, axis scales that drop no value, notes,
one colour per run.

Figures are built with the object-oriented API on an Agg canvas (no pyplot state, no backend switching).
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FixedFormatter, FixedLocator, FuncFormatter, LogLocator

from rldynamics.tracking.files import write_file

DPI = 150
REPORT_DPI = 110  # figures embedded in the HTML reports
RUN_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
RUN_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def new_figure(width: float, height: float, **kwargs: Any) -> Figure:
    """A Figure on an Agg canvas with constrained layout."""
    fig = Figure(figsize=(width, height), layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


PNG_METADATA = {"Software": None}  # no matplotlib version in the file: the same figure gives the same bytes


def save_png(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """Write `fig` as PNG (atomically, never through a link: `tracking.files`) and return the path."""
    return write_file(path, png_bytes(fig, dpi))


def png_bytes(fig: Figure, dpi: int = DPI) -> bytes:
    """`fig` encoded as PNG bytes, laid out and drawn once. `savefig` draws a figure that has a layout engine twice:
    once without rendering, only to lay it out, then for the pixels. The canvas's own `print_png` lays the figure out
    within its one draw: the same bytes in less time. The figure keeps its dpi and face colour."""
    literal_text(fig)
    buf = io.BytesIO()
    figure_dpi, face = fig.dpi, fig.get_facecolor()
    try:
        fig.set_dpi(dpi)
        fig.set_facecolor("white")
        fig.canvas.print_png(buf, metadata=PNG_METADATA)
    finally:
        fig.set_dpi(figure_dpi)
        fig.set_facecolor(face)
    return buf.getvalue()


def figure_html(fig: Figure | None, caption: str, dpi: int = REPORT_DPI) -> str:
    """`<figure>` with `fig` embedded as a base64 PNG, for the self-contained HTML reports (empty for None)."""
    if fig is None:
        return ""
    png = png_bytes(fig, dpi)
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
    data = base64.b64encode(png).decode("ascii")
    # its size stated: the page's layout is final before the images decode, so a link to a section lands there
    return (f'<figure><img alt="{html.escape(caption)}" width="{width}" height="{height}" '
            f'src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def literal_text(fig: Figure) -> None:
    """Draw every title, label, legend entry and note literally: a `$` in a run or env name never starts
    mathtext (which fails on text such as `$x^$`). Tick labels keep mathtext (log axes format `10^{k}` with it)."""
    texts = fig.findobj(Text)  # makes each axis's ticks; their labels are not formatted here (that is the draw's)
    axes = [axis for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)]
    ticks = {label for axis in axes for tick in (*axis.majorTicks, *axis.minorTicks)
             for label in (tick.label1, tick.label2)} | {axis.get_offset_text() for axis in axes}
    for text in texts:
        if text not in ticks:
            text.set_parse_math(False)


def fmt(value: float) -> str:
    """Short label for a metric value: 3 significant digits, `n/a` for missing, `±inf`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.3g}"


def auto_scale(ax, values, axis: str = "y", prefer_log: bool = False, decades: float = 1.5) -> str:
    """Pick linear / log / symlog for `axis` so no finite value is dropped; returns the scale name.

    Linear unless the non-zero magnitudes span more than `decades` decades (or `prefer_log`); then log
    when every value is positive, else symlog with the linear region up to the smallest non-zero magnitude.
    """
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    nonzero = np.abs(v[v != 0])
    if nonzero.size == 0 or not (prefer_log or nonzero.max() / nonzero.min() > 10**decades):
        return "linear"
    setter = ax.set_yscale if axis == "y" else ax.set_xscale
    if (v > 0).all():
        setter("log")
        return "log"
    linthresh = float(nonzero.min())
    setter("symlog", linthresh=linthresh)
    if (v >= 0).all():  # symlog margins would open an empty negative range below the zeros
        get, put = (ax.get_ylim, ax.set_ylim) if axis == "y" else (ax.get_xlim, ax.set_xlim)
        lo, hi = get()
        put(max(lo, -0.3 * linthresh), hi)
    return "symlog"


def readable_log_ticks(axis, zero_slot: float | None = None) -> None:
    """Tick labels of a log axis that never overlap: plain numbers (0.5, 1, 2, 5 over a few decades, powers of ten
    over more), no minor labels. With `zero_slot` (where zero-RV points sit, left of the divider at twice it) no
    decade is labelled left of the divider, where it would read as the RV of those points: the slot is labelled 0.
    Call after the axis limits are set."""
    low, high = sorted(axis.get_view_interval())
    decades = math.log10(high / low) if low > 0 else 10.0
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,), numticks=8))
    divider = zero_slot * 2.0 if zero_slot is not None else None
    axis.set_major_formatter(FuncFormatter(lambda x, _: "" if divider is not None and x < divider else f"{x:g}"))
    axis.set_minor_locator(FixedLocator([zero_slot] if zero_slot is not None else []))
    axis.set_minor_formatter(FixedFormatter(["0"] if zero_slot is not None else []))


def note(ax, text: str) -> None:
    """Centered grey message inside an axes (e.g. a metric that was not logged)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=9, wrap=True)
