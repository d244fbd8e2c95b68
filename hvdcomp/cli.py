"""The ``hvdcomp`` command: one subcommand per module, each with its own ``main(argv) -> int``."""

from __future__ import annotations

import importlib
import sys

import yaml

from hvdcomp.extras import MissingExtra

#: subcommand -> (module with main(argv), one-line description)
COMMANDS = {
    "train": ("hvdcomp.tools.train", "data-parallel training with compressed gradients (run under mpirun/horovodrun)"),
    "cluster": ("hvdcomp.tools.cluster", "emulated cluster: cluster up --hosts N --rate 100mbit | run -- CMD | down"),
    "bench": ("hvdcomp.tools.bench", "micro-benchmarks: bench compress --method NAME [--numel N] [--device cpu|cuda]"),
    "probe": ("hvdcomp.perfmodel.probe", "measure GPUs (NVML), NICs and links into a cluster YAML (under mpirun)"),
    "profile": ("hvdcomp.perfmodel.profile", "measure a model's compute and each compressor's costs into a YAML"),
    "predict": ("hvdcomp.perfmodel.predict", "predict step time and scaling per compressor from cluster + profile"),
    "k8s": ("hvdcomp.k8s.cli", "MPI Operator manifests: k8s render --config JOB | validate FILE... | dry-run FILE"),
}


def usage() -> str:
    lines = [f"  {name:<8} {description}" for name, (_, description) in COMMANDS.items()]
    return "usage: hvdcomp COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n'hvdcomp COMMAND --help' describes each command."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hvdcomp: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(COMMANDS[command][0]).main(rest)
    except (ValueError, FileNotFoundError, MissingExtra) as error:
        print(f"hvdcomp {command}: error: {error}", file=sys.stderr)
        return 2
    except yaml.YAMLError as error:  # a job, cluster or profile file that is not YAML
        print(f"hvdcomp {command}: error: not valid YAML: {error}", file=sys.stderr)
        return 2
