"""Figures of chapter 15's serving benchmark: the latency CDFs of one run, and the throughput-latency frontier.

What it adds: two plots of `minillm.serve.loadgen` reports (the JSON-able dicts `run_benchmark` returns, or read
back from `--json`), each with the service-level objectives drawn in, so a reader sees at a glance which share of
requests met them and how far a server can be pushed before they break.

- `plot_latency_cdfs(report)`: TTFT, TPOT, ITL and E2E as empirical CDFs (for each value x, the fraction of
  samples <= x), one panel each, with the SLO's bound as a vertical line: the curve's height where it crosses the
  line is the fraction of requests within that bound.
- `plot_frontier(reports)`: one point per run (a request rate or a concurrency), output token throughput against
  a latency statistic (p90 by default), with the SLO as a horizontal line: the frontier's knee is where a server
  trades latency for little more throughput.

What it leaves out: interactive plots, and one curve per request class. Figures are drawn with the Agg canvas
(no window, no global pyplot state, safe in threads and on servers) and returned; `path` also writes a PNG.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from minillm.core.config import check_choice, short_repr
from minillm.core.io import atomic_save_figure, check_output_file

# (samples key, metrics key, title, the SLO field bounding it): the four latencies, in ms on the plots
LATENCIES = (("ttft_s", "ttft_ms", "TTFT", "ttft_s"), ("tpot_s", "tpot_ms", "TPOT", "tpot_s"),
             ("itl_s", "itl_ms", "ITL", "tpot_s"), ("e2e_s", "e2e_ms", "E2E", "e2e_s"))
FRONTIER_STATS = ("mean", "p50", "p90", "p99")


def _slo_bounds(slo: Any, report: dict[str, Any] | None = None) -> dict[str, float]:
    """The SLO's bounds in seconds, {"ttft_s": ..., ...}, from an SLO-like object, a dict, or the report's config."""
    if slo is None and report is not None:
        slo = report.get("config", {}).get("slo")
    if slo is None:
        return {}
    names = ("ttft_s", "tpot_s", "e2e_s")
    if isinstance(slo, dict):
        if set(slo) - set(names):
            raise ValueError(f"slo as a dict takes {names}, got {sorted(slo)}")
        values = {name: slo.get(name) for name in names}
    elif all(hasattr(slo, name) for name in names):  # an SLO (minillm.serve.loadgen)
        values = {name: getattr(slo, name) for name in names}
    else:
        raise TypeError(f"slo must be an SLO, a dict of {names} in seconds, or None, got {type(slo).__name__}")
    bounds = {name: bound for name, bound in values.items() if bound is not None}
    for name, bound in bounds.items():
        if not isinstance(bound, (int, float)) or isinstance(bound, bool) or not 0 < bound < math.inf:
            raise ValueError(f"slo's {name} must be a positive finite number of seconds, got {short_repr(bound)}")
    return {name: float(bound) for name, bound in bounds.items()}


def _new_figure(ncols: int, width: float = 3.6, height: float = 3.0) -> tuple[Figure, list[Axes]]:
    """A Figure on the Agg canvas with `ncols` panels side by side."""
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols))


def _check_axes(axes: Any, n: int) -> list[Axes]:
    if isinstance(axes, Axes) or not isinstance(axes, (Sequence, np.ndarray)) or len(axes) != n:
        raise ValueError(f"axes must be a sequence of {n} matplotlib Axes (one per panel), got {axes!r}")
    return list(axes)


def ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF: sorted values x (n,) and y (n,) with y[i] = (i + 1) / n, the fraction <= x[i]."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"values must be a sequence of numbers, got {type(values).__name__}")
    try:
        x = np.sort(np.asarray(values, dtype=np.float64).reshape(-1))  # (n,)
    except (TypeError, ValueError):
        raise TypeError(f"values must all be numbers, got {list(values)[:5]!r}") from None
    if not np.isfinite(x).all():
        raise ValueError("values must all be finite numbers (got NaN or inf)")
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def plot_latency_cdfs(report: dict[str, Any], axes: Sequence[Axes] | None = None, slo: Any = None,
                      path: str | os.PathLike | None = None, label: str | None = None) -> Figure:
    """TTFT, TPOT, ITL and E2E empirical CDFs (ms) of one report, with the SLO's bounds as vertical lines.

    `axes`: four Axes to draw on (several reports on the same axes compare runs; `label` names this one), else a
    new figure. `slo`: an SLO (or a dict of ttft_s/tpot_s/e2e_s), default the report's. The ITL panel shows the
    TPOT bound (a per-token budget). `path`: also write the figure as PNG. Returns the Figure.
    """
    if not isinstance(report, dict) or not isinstance(report.get("samples"), dict) \
            or any(key not in report["samples"] for key, *_ in LATENCIES):
        raise ValueError(f"report must be a run_benchmark report (a dict with 'samples' holding "
                         f"{[key for key, *_ in LATENCIES]})")
    check_output_file(path, "path", (".png",))
    fig, axs = _new_figure(4) if axes is None else (None, _check_axes(axes, 4))
    bounds = _slo_bounds(slo, report)
    for ax, (key, _, title, bound) in zip(axs, LATENCIES):
        x, y = ecdf([1e3 * v for v in report["samples"][key]])  # (n,) ms, (n,) fraction
        if len(x):
            ax.step(x, y, where="post", label=label)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        if bound in bounds:
            ms = 1e3 * bounds[bound]
            met = float((x <= ms).mean()) if len(x) else 0.0
            ax.axvline(ms, color="tab:red", linestyle="--",
                       label=f"{bound[:-2].upper()} SLO {ms:g} ms ({100 * met:.0f}% within)")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small", loc="lower right")
    axs[0].set_ylabel("fraction of samples <= x")
    fig = fig if fig is not None else axs[0].figure
    if path is not None:
        atomic_save_figure(fig, path, dpi=120)
    return fig


def _run_label(report: dict[str, Any]) -> str:
    """"4 req/s", "C=16", "inf req/s, C=32": what the run's arrivals were."""
    cfg = report.get("config", {})
    rate, conc = cfg.get("request_rate"), cfg.get("max_concurrency")
    parts = [] if rate == "inf" and conc is not None else [f"{rate:g} req/s" if rate != "inf" else "inf req/s"]
    return ", ".join(parts + ([f"C={conc}"] if conc is not None else []))


def plot_frontier(reports: Sequence[dict[str, Any]], slo: Any = None, stat: str = "p90",
                  axes: Sequence[Axes] | None = None, path: str | os.PathLike | None = None) -> Figure:
    """Output token throughput (tok/s) against TTFT, TPOT and E2E `stat` (ms), one point per report.

    Points are joined in the order of their throughput and labelled with their rate or concurrency; the SLO's
    bounds (default: the first report's) are horizontal lines. `stat`: "mean", "p50", "p90" or "p99". `axes`:
    three Axes, else a new figure; `path`: also write a PNG. Returns the Figure.
    """
    stat = check_choice("stat", stat, FRONTIER_STATS)
    if isinstance(reports, dict) or not isinstance(reports, Sequence) or not reports:
        raise ValueError("reports must be a non-empty list of run_benchmark reports")
    for i, r in enumerate(reports):
        metrics = r.get("metrics") if isinstance(r, dict) else None
        if not isinstance(metrics, dict) or any(k not in metrics for k in ("output_throughput", "ttft_ms", "tpot_ms",
                                                                             "e2e_ms")):
            raise ValueError(f"reports[{i}] must be a run_benchmark report (a dict with 'metrics' holding "
                             f"output_throughput, ttft_ms, tpot_ms and e2e_ms)")
    check_output_file(path, "path", (".png",))
    fig, axs = _new_figure(3) if axes is None else (None, _check_axes(axes, 3))
    bounds = _slo_bounds(slo, reports[0])
    order = sorted(reports, key=lambda r: r["metrics"]["output_throughput"])
    throughput = [r["metrics"]["output_throughput"] for r in order]  # (runs,) tok/s
    for ax, (_, key, title, bound) in zip(axs, (LATENCIES[0], LATENCIES[1], LATENCIES[3])):
        ys = [(r["metrics"][key] or {}).get(stat, np.nan) for r in order]  # (runs,) ms, NaN: no sample
        ax.plot(throughput, ys, marker="o")
        for x, y, r in zip(throughput, ys, order):
            ax.annotate(_run_label(r), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
        if bound in bounds:
            ax.axhline(1e3 * bounds[bound], color="tab:red", linestyle="--", label=f"SLO {1e3 * bounds[bound]:g} ms")
            ax.legend(fontsize="x-small", loc="upper left")
        ax.set_title(f"{stat} {title}")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    fig = fig if fig is not None else axs[0].figure
    if path is not None:
        atomic_save_figure(fig, path, dpi=120)
    return fig
