"""``hvdcomp k8s``: render, validate and dry-run MPIJob manifests for the Kubeflow MPI Operator.

    hvdcomp k8s render --config k8s-job.yaml > job.k8s.yaml   # ConfigMap + MPIJob (see hvdcomp/k8s/render.py)
    hvdcomp k8s validate job.k8s.yaml                         # offline: strict schemas + operator and hvdcomp rules
    hvdcomp k8s dry-run job.k8s.yaml                          # run the launcher's command on emulated hosts (root)
    kubectl apply -f job.k8s.yaml
"""

from __future__ import annotations

import argparse
import sys

from hvdcomp.k8s import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp k8s", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    render_parser = commands.add_parser("render", help="print the ConfigMap and MPIJob of a job description")
    render_parser.add_argument("--config", required=True, help="the job description (YAML; see render.py)")
    render_parser.add_argument("--output", "-o", help="write to this file instead of standard output")
    validate_parser = commands.add_parser("validate", help="check manifests offline")
    validate_parser.add_argument("files", nargs="+", metavar="FILE")
    validate_parser.add_argument("--kubernetes-version",
                                 help="the Kubernetes version whose schemas pod templates are checked against "
                                      "(default: the newest that kubernetes-validate ships)")
    dry_run_parser = commands.add_parser("dry-run", help="run an MPIJob's launcher command on emulated hosts")
    dry_run_parser.add_argument("file", metavar="FILE")
    dry_run_parser.add_argument("--timeout", type=float, default=600, help="seconds before the run is killed")
    args = parser.parse_args(argv)

    if args.command == "render":
        text = render.render(render.load(args.config))
        if args.output:
            with open(args.output, "w") as stream:
                stream.write(text)
        else:
            sys.stdout.write(text)
        return 0
    if args.command == "validate":  # imported here: validate and dry-run need the k8s extra, render does not
        from hvdcomp.k8s import validate

        version = args.kubernetes_version or validate.latest_version()
        problems = validate.validate_files(args.files, version)
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{len(args.files)} file(s): {len(problems)} problem(s) (Kubernetes {version} schemas)",
              file=sys.stderr if problems else sys.stdout)
        return 1 if problems else 0
    from hvdcomp.k8s import dryrun

    return dryrun.main_dry_run(args.file, args.timeout)
