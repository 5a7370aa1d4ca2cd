"""The README's picture: DALI images/s from one run of ``bench_passthrough.py --parts dali``, as a bar chart.

    python scripts/bench/chart_readme.py [--run out/bench-pt/passthrough-dali2.json] [--png docs/throughput.png]

It draws what that run measured (the median of its repeats per configuration, every repeat as a dot), nothing
else: the numbers and the command that made them are in BENCHMARKS.md ("FUSE passthrough vs the daemon path").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (label on the chart, the configuration's name in the JSON)
_BARS = (
    ("all PNG\n(read directly)", "r=0 direct (all-PNG), cold"),
    ("all PNG\nthrough liquidfs", "r=0 liquidfs passthrough, cold"),
    ("all raw\nthrough liquidfs", "r=1 liquidfs passthrough, cold"),
    ("all BMP copy\n(read directly)", "r=1 direct (all-BMP copy), cold"),
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --run, not --json: in the benchmarks --json names the results they write, and this reads one
    parser.add_argument("--run", type=Path, metavar="PATH",
                        default=REPO / "out" / "bench-pt" / "passthrough-dali2.json",
                        help="the JSON of that bench_passthrough.py run (default out/bench-pt/passthrough-dali2.json)")
    parser.add_argument("--png", type=Path, metavar="PATH", default=REPO / "docs" / "throughput.png",
                        help="the chart to write (default docs/throughput.png)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart_readme: needs matplotlib (pip install -e .[bench])", file=sys.stderr)
        return 2
    run = json.loads(args.run.read_text())
    by_config = {row["config"]: row for row in run["dali"]}
    missing = [name for _, name in _BARS if name not in by_config]
    if missing:
        print(f"chart_readme: {args.run} lacks {', '.join(missing)}", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 3.6))
    baseline = by_config[_BARS[0][1]]["images_per_s"]
    for x, (label, name) in enumerate(_BARS):
        row = by_config[name]
        ax.bar(x, row["images_per_s"], color="tab:blue" if "liquidfs" in name else "0.7")
        ax.plot([x] * len(row["runs"]), row["runs"], "k.", markersize=4)
        ax.text(x, max(row["runs"] + [row["images_per_s"]]) * 1.02, f"{row['images_per_s']:.0f}  ({row['images_per_s'] / baseline:.2f}x)",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(_BARS)), [label for label, _ in _BARS], fontsize=9)
    ax.set_ylabel("images/s")
    ax.set_ylim(0, max(max(by_config[n]["runs"]) for _, n in _BARS) * 1.15)
    ax.set_title(f"Unmodified DALI (CPU decode, 2 cores), {run['images']:,} 2048x1024 images, cold storage",
                 fontsize=10)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=100)
    print(f"chart_readme: wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
