"""The performance model's step time of each gathered method by two-phase against by allgather, per profile and preset.

    .venv/bin/python perf/perfmodel/two_phase_vs_allgather.py --workers 64 \\
        --profile perf/results/gpu-h200/profile-resnet18-cuda.yaml \\
        --profile perf/results/gpu-h100-kernels/3-843b491/kernels/profile-resnet50-cuda.yaml

One JSON line per profile, preset and method: both predicted step times (ms) and their ratio (two-phase / allgather),
then the range of the ratios per profile and preset. Predictions from measured profiles (``hvdcomp profile``) and
nominal presets, not measurements: they tell where ``collective: auto``'s two-phase (from 5 ranks on) is predicted to
lose, since it compresses and decodes each of a gradient's chunks in a call of its own (docs/perfmodel.md).
"""

from __future__ import annotations

import argparse
import json
import time

from hvdcomp.perfmodel import predict, schema, timeline
from hvdcomp.reductions import allowed

PRESETS = ("gtx1080-pcie-1gbe", "a100-nvlink-100gbe", "h100-nvlink-ib400")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="append", required=True, help="a profile YAML file (repeatable)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--out", help="append the JSON lines to this file too")
    args = parser.parse_args()
    lines = []
    for path in args.profile:
        profile = schema.load(path, "profile")
        for preset in PRESETS:
            cluster = predict.load_cluster(preset)
            ratios = []
            for method, compressor in profile.compressors.items():
                if not {"two_phase", "allgather"} <= set(allowed(compressor)):
                    continue
                two_phase = timeline.simulate(profile, cluster, method, args.workers, "two_phase").step_s * 1e3
                allgather = timeline.simulate(profile, cluster, method, args.workers, "allgather").step_s * 1e3
                ratios.append(two_phase / allgather)
                lines.append({"profile": path, "preset": preset, "workers": args.workers, "method": method,
                              "two_phase_ms": round(two_phase, 1), "allgather_ms": round(allgather, 1),
                              "ratio": round(two_phase / allgather, 2)})
            print(f"{path} {preset}: two-phase / allgather {min(ratios):.2f} to {max(ratios):.2f} "
                  f"({len(ratios)} methods, {args.workers} workers)")
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = "".join(json.dumps({**line, "date": date}) + "\n" for line in lines)
    print(text, end="")
    if args.out:
        with open(args.out, "a") as out:
            out.write(text)


if __name__ == "__main__":
    main()
