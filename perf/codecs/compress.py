"""Compressor micro-benchmark sweep: every method at one size, appended to perf/results/compress.jsonl.

    .venv/bin/python perf/codecs/compress.py [--numel 25000000] [--device cpu|cuda] [--methods NAME ...]  # default: all

Each line is the JSON of ``hvdcomp bench compress`` plus the time and host; perf/results/compress.png plots
compress+decompress throughput against the memory-copy throughput measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from hvdcomp.methods import METHODS
from hvdcomp.tools.bench import bench_compress

RESULTS = Path(__file__).resolve().parents[1] / "results"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["method"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.bar(labels, [row["compress_decompress_gbps"] for row in rows], label="compress + decompress")
    axis.axhline(rows[0]["copy_gbps"], color="black", linestyle="--", label="x.clone() (same run)")
    axis.axhline(0.3 * rows[0]["copy_gbps"], color="gray", linestyle=":", label="30% of copy")
    for i, row in enumerate(rows):
        axis.annotate(f"{row['bits_per_element']:.2f} bit/el", (i, row["compress_decompress_gbps"]),
                      ha="center", va="bottom", fontsize=8)
    axis.set_ylabel("GB/s of float32 input")
    axis.set_title(f"{rows[0]['numel'] / 1e6:.0f} M elements, {rows[0]['device']} ({rows[0]['threads']} threads)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--methods", nargs="+", default=sorted(set(METHODS) - {"none"}))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for method in args.methods:
        row = bench_compress(method, args.numel, args.device, args.repeats)
        row.update(time=time.strftime("%Y-%m-%dT%H:%M:%S"), host=platform.node())
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(RESULTS / "compress.jsonl", "a") as stream:
        stream.writelines(json.dumps(row) + "\n" for row in rows)
    plot(rows, RESULTS / f"compress-{args.device}.png")


if __name__ == "__main__":
    main()
