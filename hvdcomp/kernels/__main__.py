"""``python -m hvdcomp.kernels --build``: compile the fused CPU kernels ahead of time."""

import argparse
import time

from hvdcomp.kernels import build

parser = argparse.ArgumentParser(prog="python -m hvdcomp.kernels", description=__doc__)
parser.add_argument("--build", action="store_true", required=True, help="compile (or load from the cache)")
parser.parse_args()
start = time.perf_counter()
module = build()
print(f"hvdcomp kernels ready: {module.__file__} ({time.perf_counter() - start:.1f} s)")
