"""The ``hvdcomp`` command: ``hvdcomp train`` (run under mpirun/horovodrun) and ``hvdcomp bench``."""

from __future__ import annotations

import sys

USAGE = """usage: hvdcomp COMMAND [ARGS]

commands:
  train   data-parallel training with compressed gradients (run under mpirun or horovodrun)
  bench   micro-benchmarks: hvdcomp bench compress --method NAME [--numel N] [--device cpu|cuda] --json

'hvdcomp COMMAND --help' describes each command."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from hvdcomp.train import main as run
    elif command == "bench":
        from hvdcomp.bench import main as run
    else:
        print(f"hvdcomp: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return run(rest)
    except (ValueError, FileNotFoundError) as error:
        print(f"hvdcomp {command}: error: {error}", file=sys.stderr)
        return 2
