"""``hvdcomp k8s dry-run FILE``: do here what the MPI Operator would do with an MPIJob, and train for real.

1. Validate the file (:mod:`hvdcomp.k8s.validate`); an invalid manifest is not run.
2. Write the ConfigMap the operator mounts at ``/etc/mpi``: ``hostfile`` (``<job>-worker-<i>.<job>.<namespace>.svc
   slots=<slotsPerWorker>``, one line per worker) and ``discover_hosts.sh``; write the job's own ConfigMaps (from
   the same file) where its pods mount them.
3. Start one emulated host per worker pod (:mod:`hvdcomp.tools.cluster`: network namespaces whose interface is
   ``eth0``, as a pod's), with the network interface setting mapped to theirs.
4. Map the image's paths to this checkout (``/opt/hvdcomp`` -> the checkout, its ``.venv/bin`` first on PATH) and
   the mounts to the files of step 2, expand ``$(VAR)`` as the kubelet does, and run the launcher container's
   command: its ``-np``, hostfile and options parsed by horovodrun's own argument parser (or as mpirun's), the
   training command started on the hosts, with the environment the launcher passes on to the ranks (horovodrun:
   all of it, plus its options as ``HOROVOD_*`` variables; mpirun: the ``-x`` variables).

What it proves: the manifest's command line, arguments, environment, ConfigMap contents and rank count train
(for as many steps as the job's own arguments ask; use a small job such as k8s/overlays/cpu-smoke). What it
does not: the image (run from this checkout instead), ssh between pods, GPUs, the scheduler. The emulated
cluster runs one rank per host, so a dry run needs ``slotsPerWorker: 1``. Needs root (network namespaces).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hvdcomp.k8s import validate
from hvdcomp.k8s.render import HOSTFILE, IMAGE_ROOT, INTERFACE_VAR
from hvdcomp.tools import cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER_NAME = "k8sdry"
MPI_DIR = str(Path(HOSTFILE).parent)
#: mpirun options the dry run understands (with a value / without); anything else is refused, not ignored.
MPIRUN_VALUE_OPTIONS = ("-np", "--np", "-n", "--n", "-c", "--hostfile", "-hostfile", "--machinefile",
                        "-machinefile", "-x", "--mca", "-mca", "--bind-to", "-bind-to", "--map-by", "-map-by")
MPIRUN_FLAGS = ("--allow-run-as-root", "--oversubscribe", "--tag-output", "-tag-output", "--display-map",
                "--report-bindings", "-v", "--verbose")


@dataclass
class Launch:
    """What the launcher's command asks for."""

    program: str
    np: int
    hostfile: str | None
    command: list[str]
    env: dict[str, str]
    controller: str
    notes: list[str]


def operator_hostfile(job: Mapping[str, Any]) -> tuple[str, str]:
    """(hostfile, discover_hosts.sh) as the operator writes them into the ``<job>-config`` ConfigMap."""
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    spec = job["spec"]
    slots = spec.get("slotsPerWorker", 1)
    workers = spec["mpiReplicaSpecs"]["Worker"].get("replicas", 0)  # (the operator's default)
    hosts = [f"{name}-worker-{i}.{name}.{namespace}.svc" for i in range(workers)]
    if spec.get("runLauncherAsWorker"):
        hosts.insert(0, f"{name}-launcher.{name}.{namespace}.svc")
    hostfile = "".join(f"{host} slots={slots}\n" for host in hosts)
    discover = "#!/bin/sh\n" + "".join(f"echo {host}\n" for host in hosts)  # no slots: horovodrun --slots
    return hostfile, discover


def map_paths(value: str, mapping: Mapping[str, str]) -> str:
    """Replaces each image path prefix (a whole path component) with where it lives here."""
    for image_path in sorted(mapping, key=len, reverse=True):
        value = re.sub(rf"(?<![\w./-]){re.escape(image_path)}(?=/|$|[\s:=,;\"'])",
                       lambda _, image_path=image_path: mapping[image_path], value)
    return value


def parse_horovodrun(argv: list[str]) -> Launch:
    """horovodrun's own parser reads the arguments; its options become HOROVOD_* variables as horovodrun sets them."""
    from horovod.runner.common.util import config_parser

    args = validate.horovodrun_args(argv)
    if not args.command:
        raise ValueError("the horovodrun command line has no training command after its options")
    env: dict[str, str] = {}
    config_parser.set_env_from_args(env, args)
    notes = [f"horovodrun --network-interfaces {','.join(args.nics)}: the emulated hosts' {cluster.INTERFACE}"
             ] if args.nics else []
    return Launch("horovodrun", args.num_proc, args.hostfile, list(args.command), env,
                  "gloo" if args.use_gloo else "mpi", notes)


def parse_mpirun(argv: list[str], container_env: Mapping[str, str]) -> Launch:
    """The subset of mpirun's options that the operator's examples and hvdcomp's render use."""
    np, hostfile, env, notes = None, None, {}, []
    position = 1
    while position < len(argv) and argv[position].startswith("-"):
        option = argv[position]
        if option in MPIRUN_FLAGS:
            position += 1
            continue
        if option not in MPIRUN_VALUE_OPTIONS or position + 1 >= len(argv):
            raise ValueError(f"dry-run does not know the mpirun option {option!r}; it understands "
                             f"{', '.join(MPIRUN_VALUE_OPTIONS + MPIRUN_FLAGS)}")
        value = argv[position + 1]
        if option in ("-np", "--np", "-n", "--n", "-c"):
            np = int(value)
        elif option.lstrip("-") in ("hostfile", "machinefile"):
            hostfile = value
        elif option == "-x":
            key, _, given = value.partition("=")
            env[key] = given if given else container_env.get(key, os.environ.get(key, ""))
        elif option.lstrip("-") == "mca":
            notes.append(f"--mca {value} {argv[position + 2]}: not applied; the emulated cluster sets Open MPI's "
                         "transport and interfaces")
            position += 1
        position += 2
    if np is None:
        raise ValueError("the mpirun command line has no -np")
    if position >= len(argv):
        raise ValueError("the mpirun command line has no program after its options")
    return Launch("mpirun", np, hostfile, argv[position:], env, "mpi", notes)


def _write_config_maps(job: Mapping[str, Any], config_maps: Mapping[str, Mapping[str, Any]],
                       root: Path) -> dict[str, str]:
    """Writes every ConfigMap volume mounted by the launcher or the first worker container; returns the mounts."""
    mounts: dict[str, str] = {}
    for role in ("Launcher", "Worker"):
        pod = job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
        volumes = {volume["name"]: volume for volume in pod.get("volumes") or []}
        for mount in pod["containers"][0].get("volumeMounts") or []:
            source = volumes.get(mount["name"], {}).get("configMap")
            if source is None or mount["mountPath"] in mounts:
                continue
            if source["name"] not in config_maps:
                raise ValueError(f"{role} mounts the ConfigMap {source['name']!r} at {mount['mountPath']}, but the "
                                 "file has no ConfigMap of that name: render it with 'hvdcomp k8s render'")
            directory = root / "configmaps" / source["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for key, text in (config_maps[source["name"]].get("data") or {}).items():
                (directory / key).write_text(text)
            mounts[mount["mountPath"]] = str(directory)
    return mounts


def prepare(documents: list[Any], root: Path) -> tuple[Launch, dict[str, Any], int]:
    """(the launch, the MPIJob, the number of hosts) for the single MPIJob in ``documents``; files under root."""
    jobs = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == "MPIJob"]
    if len(jobs) != 1:
        raise ValueError(f"the file must hold exactly one MPIJob; it holds {len(jobs)}")
    job = jobs[0]
    spec = job["spec"]
    slots = spec.get("slotsPerWorker", 1)
    if slots != 1:
        raise ValueError(f"spec.slotsPerWorker is {slots}: the emulated cluster runs one rank per host (one per "
                         "worker pod); dry-run a job with slotsPerWorker: 1, such as k8s/overlays/cpu-smoke")
    hosts = spec["mpiReplicaSpecs"]["Worker"].get("replicas", 0) + (1 if spec.get("runLauncherAsWorker") else 0)
    config_maps = {d["metadata"]["name"]: d for d in documents
                   if isinstance(d, Mapping) and d.get("kind") == "ConfigMap"}
    etc_mpi = root / "etc-mpi"
    etc_mpi.mkdir(parents=True)
    hostfile, discover = operator_hostfile(job)
    (etc_mpi / "hostfile").write_text(hostfile)
    (etc_mpi / "discover_hosts.sh").write_text(discover)
    (etc_mpi / "discover_hosts.sh").chmod(0o755)
    mapping = {IMAGE_ROOT: str(REPO), MPI_DIR: str(etc_mpi), **_write_config_maps(job, config_maps, root)}

    container = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    env_vars = [dict(var) for var in container.get("env") or []]
    for var in env_vars:  # the interface of a pod here is the emulated hosts'
        if var.get("name") == INTERFACE_VAR:
            var["value"] = cluster.INTERFACE
    container = {**container, "env": env_vars}
    container_env = {key: map_paths(value, mapping) for key, value in validate.container_env(container).items()}
    argv = [map_paths(word, mapping) for word in validate.launcher_argv(container)]
    program = Path(argv[0]).name if argv else ""
    if program == "horovodrun":
        launch = parse_horovodrun(argv)
        launch.env = {**container_env, **launch.env}  # horovodrun passes its whole environment on
    elif program == "mpirun":
        launch = parse_mpirun(argv, container_env)
        launch.hostfile = launch.hostfile or str(etc_mpi / "hostfile")  # the operator's OMPI_MCA_orte_default_hostfile
    else:
        raise ValueError(f"the launcher runs {argv[:1]}, not horovodrun or mpirun: nothing to dry-run")
    launch.env["PATH"] = f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    if launch.np != hosts * slots:
        raise ValueError(f"-np {launch.np} but {hosts} hosts x {slots} slots")
    if launch.hostfile is not None:  # horovodrun without --hostfile: -H or discovery, left to horovodrun's checks
        written = Path(launch.hostfile)
        if written != etc_mpi / "hostfile":
            raise ValueError(f"the launcher reads the hostfile {launch.hostfile}; the operator writes {HOSTFILE}")
        listed = sum(int(line.split("slots=")[1]) for line in written.read_text().splitlines())
        if listed != launch.np:
            raise ValueError(f"-np {launch.np}, but the hostfile lists {listed} slots")
    return launch, job, hosts


def main_dry_run(path: str, timeout: float) -> int:
    with open(path) as stream:
        documents = [d for d in yaml.safe_load_all(stream) if d is not None]
    problems = validate.validate_files([path], validate.latest_version())
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        raise ValueError(f"{path} does not validate ({len(problems)} problem(s) above): fix them first")
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise ValueError("dry-run starts network namespaces: run it as root on Linux with iproute2 (ip, tc)")
    with tempfile.TemporaryDirectory(prefix="hvdcomp-dry-run-") as tmp:
        launch, job, hosts = prepare(documents, Path(tmp))
        print(f"dry-run of MPIJob {job['metadata']['name']}: {hosts} emulated host(s), {launch.np} rank(s), "
              f"{launch.program} ({launch.controller} controller)")
        print(f"  /etc/mpi/hostfile -> {tmp}/etc-mpi/hostfile:")
        print("".join(f"    {line}\n" for line in Path(tmp, "etc-mpi", "hostfile").read_text().splitlines()), end="")
        print(f"  {IMAGE_ROOT} -> {REPO}; network interface -> {cluster.INTERFACE} of the emulated hosts")
        for note in launch.notes:
            print(f"  {note}")
        print(f"  command: {' '.join(launch.command)}", flush=True)
        emulated = cluster.up(hosts, name=CLUSTER_NAME)
        try:
            argv = emulated.launch_command(launch.command, launch.env, controller=launch.controller)
            process = subprocess.Popen(argv, cwd=tmp, start_new_session=True)
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
                raise ValueError(f"the launcher's command did not finish within {timeout:.0f} s (hang?)") from None
        finally:
            cluster.down(CLUSTER_NAME)

