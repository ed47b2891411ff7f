"""`zoff plot`: loss, val loss, tokens/s and memory (rank 0's peak RSS; the GPU allocator's peak) against step for one or more run directories, as one PNG.

matplotlib is an optional extra (`pip install zoff[plot]`). `plot_runs` returns the data of every curve it
drew, read back from the figure, so what the picture shows can be checked against metrics.jsonl.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from zoff.errors import UserError

SERIES = ("loss", "val_loss", "tokens_per_s", "peak_rss_mib", "peak_alloc_mib")


@dataclass
class RunSeries:
    """One run's curves: (steps, values) per metric."""

    label: str
    curves: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)


def read_series(run_dir: Path) -> RunSeries:
    """loss, val_loss and tokens_per_s against step, from the run's metrics.jsonl (events skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (not a zoff run directory, or no step logged yet)")
    out = RunSeries(str(run_dir))
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not valid JSON") from None
        if "event" in rec or "step" not in rec:
            continue
        for key in SERIES:
            if isinstance(rec.get(key), (int, float)):
                steps, values = out.curves.setdefault(key, ([], []))
                steps.append(rec["step"])
                values.append(rec[key])
    return out


def plot_runs(run_dirs: list[Path], out: Path) -> dict[str, RunSeries]:
    """Draw every run into one PNG at `out`; returns {label: curves as drawn}."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("zoff plot: needs matplotlib: pip install zoff[plot]") from None
    if not out.parent.is_dir():
        raise UserError(f"--out: its folder {out.parent} does not exist")
    runs = [read_series(Path(d)) for d in run_dirs]
    labels = _labels([Path(d) for d in run_dirs])
    fig, (ax_loss, ax_tps, ax_mem) = plt.subplots(1, 3, figsize=(17, 4.5))
    drawn: dict[str, RunSeries] = {}
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = f"C{i % 10}"
        drawn[label] = RunSeries(label)
        styles = {
            "loss": (ax_loss, "-", None),
            "val_loss": (ax_loss, "--", "o"),
            "tokens_per_s": (ax_tps, "-", None),
            "peak_rss_mib": (ax_mem, "-", None),
            "peak_alloc_mib": (ax_mem, ":", None),
        }
        for key, (ax, ls, marker) in styles.items():
            if key not in run.curves:
                continue
            steps, values = run.curves[key]
            name = {"val_loss": f"{label} (val)", "peak_rss_mib": f"{label} (host RSS)"}.get(key, label)
            name = f"{label} (GPU allocated)" if key == "peak_alloc_mib" else name
            (line,) = ax.plot(steps, values, ls, marker=marker, color=color, label=name, markersize=4)
            drawn[label].curves[key] = (
                [float(x) for x in line.get_xdata()],
                [float(y) for y in line.get_ydata()],
            )
    ax_loss.set(title="loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_tps.set(title="throughput", xlabel="step", ylabel="tokens/s")
    ax_mem.set(title="memory (rank 0, peak so far)", xlabel="step", ylabel="MiB")
    for ax in (ax_loss, ax_tps, ax_mem):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def _labels(dirs: list[Path]) -> list[str]:
    """Run folder names, with their parent folder where two runs share a name, numbered if still equal."""
    names = [d.resolve().name for d in dirs]
    labels = [f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(dirs, names)]
    return [
        f"{lab} #{labels[:i].count(lab) + 1}" if labels.count(lab) > 1 else lab
        for i, lab in enumerate(labels)
    ]
