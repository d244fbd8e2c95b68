"""Registers and spills of the selection's Triton kernels on a Hopper GPU, from the compiler alone (no GPU needed).

    .venv/bin/python perf/gpu/registers.py [--warps 4 16] [--tag TEXT] [--out perf/results/registers.jsonl]
    HVDCOMP_LAUNCHES=/tmp/launches.jsonl .venv/bin/python -m pytest tests/test_triton.py   # every kernel's launches
    .venv/bin/python perf/gpu/registers.py --launches /tmp/launches.jsonl [--max-bits 4] [--out ...]

Each kernel of :mod:`hvdcomp.kernels.gpu.select` that reads a 4,096-entry block per program, as the sparsifiers launch
it on 25 M float32 entries (top-k's and threshold's, int32 indices), is compiled by Triton for sm_90a (H100, H200) at
each ``--warps`` and its PTX assembled by the ``ptxas`` Triton uses, whose ``-v`` report gives the registers a thread
uses and the bytes it spills. A Hopper SM holds 65,536 registers and 64 warps, so registers decide how many programs
run at once: at 208 registers a thread (the gathering at 4 warps) 2 programs of 4 warps fit, 8 warps of 64; whether a
kernel is then slow is for a GPU to time (``perf/gpu/kernel_times.py``). One JSON line per kernel and warp count, with
``--tag`` (which code was compiled, say). With ``--launches``, instead, every launch the interpreter tests made (a
covering set of them: each kernel with each of its constants, ``tests/triton_compile.py``), as they launched it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels (before hvdcomp.kernels.gpu defines them)

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hvdcomp.kernels.gpu import select
from hvdcomp.tools.bench import record

_SELECTION = {"x_ptr": "*fp32", "threshold_ptr": "*i32", "keys_ptr": "*i32", "index_ptr": "*i64", "found_ptr": "*i64",
              "counts_ptr": "*i64", "n": "i32", "k": "i32", "capacity": "i32"}
_BLOCKS = {"BLOCK": 4096}
#: (kernel, its signature, its constants), as topk() launches them on 25 M entries (with a threshold too: threshold's)
KERNELS: list[tuple[str, dict[str, str], dict[str, Any]]] = [
    ("_one_block_kernel", {"x_ptr": "*fp32", "threshold_ptr": "*i32", "values_ptr": "*fp32", "indices_ptr": "*i32",
                           "n": "i32", "k": "i32"}, {"THRESHOLD": False, **_BLOCKS}),
    ("_bound_kernel", {"x_ptr": "*fp32", "bound_ptr": "*i32", "n": "i32", "stride": "i32", "rank": "i32"},
     {"SAMPLE": select._SAMPLE}),
    ("_candidates_kernel", {"x_ptr": "*fp32", "threshold_ptr": "*i32", "bound_ptr": "*i32", "found_ptr": "*i64",
                            "n": "i32"}, {"THRESHOLD": False, **_BLOCKS}),
    ("_gather_kernel", {"x_ptr": "*fp32", "threshold_ptr": "*i32", "bound_ptr": "*i32", "found_ptr": "*i64",
                        "keys_ptr": "*i32", "index_ptr": "*i64", "n": "i32", "capacity": "i32"},
     {"THRESHOLD": False, **_BLOCKS}),
    *[(name, signature, {**constants, "THRESHOLD": threshold, "GATHERED": gathered, **_BLOCKS})
      for threshold in (False, True) for gathered in (False, True)
      for name, signature, constants in [
          ("_histogram_kernel", _SELECTION, {"PASS": 1}),
          ("_count_kernel", {**_SELECTION, "scans_ptr": "*i64"}, {}),
          ("_compact_kernel", {**_SELECTION, "scans_ptr": "*i64", "values_ptr": "*fp32", "indices_ptr": "*i32"},
           {})]],
]


def ptxas_path() -> Path:
    """The ptxas Triton compiles with for Hopper (its own, or ``TRITON_PTXAS_PATH``)."""
    return Path(knobs.nvidia.ptxas.path)


def ptxas_report(kernel: Any, signature: dict[str, str], constants: dict[str, Any],
                 options: dict[str, Any]) -> dict[str, Any]:
    """One kernel compiled for sm_90a with ``options``: ptxas's registers a thread, spilled bytes, shared memory. Its
    pointers are marked 16-byte aligned, as a launch marks PyTorch's allocations (which lets loads vectorize); ptxas
    runs as Triton runs it (``--fmad=false`` where ``enable_fp_fusion`` is off)."""
    full = {**signature, **{constant: "constexpr" for constant in constants}}
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in signature.items() if kind.startswith("*")}
    compiled = triton.compile(ASTSource(kernel, full, constants, aligned), target=GPUTarget("cuda", 90, 32),
                              options=options)
    fmad = [] if options.get("enable_fp_fusion", True) else ["--fmad=false"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([str(ptxas_path()), *fmad, "-v", "--gpu-name=sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.findall(pattern, report)
        if len(found) != 1:  # one entry function, whose report names each figure once
            raise RuntimeError(f"{kernel.__name__}: {len(found)} matches of {pattern!r} in ptxas's report:\n{report}")
        return int(found[0])

    return {"kernel": kernel.__name__, "constants": {k: v for k, v in constants.items() if k != "BLOCK"},
            "warps": options.get("num_warps", 4), "registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"), "spill_loads": number(r"(\d+) bytes spill loads"),
            "shared_bytes": compiled.metadata.shared, "target": "sm_90a", "triton": triton.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tag", default="", help="recorded with each row")
    parser.add_argument("--launches", type=Path, help="the interpreter tests' launches (HVDCOMP_LAUNCHES)")
    parser.add_argument("--max-bits", type=int, help="with --launches, leave out those with a BITS constant above "
                        "this (ORQ's widest level searches take minutes each to compile)")
    parser.add_argument("--out", type=Path, default=Path("perf/results/registers.jsonl"))
    args = parser.parse_args()
    if args.launches:
        for line in args.launches.read_text().splitlines():
            launch = json.loads(line)
            bits = launch["arguments"].get("BITS", [None, 0])[1] or 0
            if args.max_bits is not None and bits > args.max_bits:
                continue
            kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
            given = {p.name: launch["arguments"][p.name] for p in kernel.params if p.name in launch["arguments"]}
            signature = {name: kind for name, (kind, _) in given.items() if kind != "constexpr"}
            constants = {name: value for name, (kind, value) in given.items() if kind == "constexpr"}
            row = ptxas_report(kernel, signature, constants, launch["options"])
            record({**row, "module": launch["module"], "tag": args.tag}, args.out)
        return
    for name, signature, constants in KERNELS:
        for warps in args.warps:
            row = ptxas_report(getattr(select, name), signature, constants, {"num_warps": warps})
            record({**row, "tag": args.tag}, args.out)


if __name__ == "__main__":
    main()
