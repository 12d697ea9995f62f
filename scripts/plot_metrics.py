"""Loss, tokens/s and MFU curves of one or several runs, as one PNG.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out metrics.png]

Reads each run's metrics.jsonl (written every log.every steps); a run resumed several times
keeps the last line of each step. Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (("loss", "loss"), ("tokens_per_s_per_device", "tokens/s per device"), ("mfu", "MFU"))


class PlotError(ValueError):
    pass


def read_metrics(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} does not exist; give the output_dir of a run that has logged a step")
    rows = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            raise PlotError(f"{path} line {number} is not a metrics record") from None
    return dict(sorted(rows.items()))


def plot(run_dirs: list[Path], out: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed; pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) for d in run_dirs}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    for ax, (key, title) in zip(axes, PANELS):
        for name, rows in runs.items():
            points = [(step, row[key]) for step, row in rows.items() if row.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=name, marker="." if len(points) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss, tokens/s and MFU of runs to a PNG.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=Path("metrics.png"), help="default: metrics.png")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot(args.run_dirs, args.out)}")
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
