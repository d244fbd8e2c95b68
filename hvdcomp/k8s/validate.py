"""Offline validation of MPIJob manifests: ``hvdcomp k8s validate FILE...``.

No cluster is needed. Each YAML document is checked in three layers, and every problem names its field path
and the fix:

1. An ``MPIJob`` against ``mpijob.schema.json``: the MPI Operator's published CRD schema (v0.8.2) made strict,
   so unknown fields and wrong types are rejected (a cluster would silently prune unknown fields).
2. Each pod template, wrapped as a core ``v1 PodTemplate``, and every other object against Kubernetes' own
   OpenAPI schemas in strict mode, through PyPI's ``kubernetes-validate``.
3. The rules the operator's controller enforces beyond its schema (github.com/kubeflow/mpi-operator,
   pkg/apis/kubeflow/validation/validation.go; ../shared/notes/deploy.md), and hvdcomp's own rules for a job
   that works first time: GPU requests equal limits, one rank per GPU, a memory-backed /dev/shm, ``-np`` equal
   to workers x slotsPerWorker, an explicit run policy, WaitForWorkersReady with a worker readiness probe, and
   CPU/memory requests and limits on every container.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any
from unittest import mock

import yaml

from hvdcomp import extras
from hvdcomp.config import CompressionConfig
from hvdcomp.k8s.render import CLEAN_POD_POLICIES, CONFIG_KEY, GPU, LAUNCHERS, OPERATOR_OBJECTS

with extras.required("k8s", "hvdcomp k8s validate and dry-run"):
    import jsonschema
    import kubernetes_validate
    import kubernetes_validate.utils

RESTART_POLICIES = ("Never", "OnFailure")
LAUNCHER_CREATION_POLICIES = ("AtStartup", "WaitForWorkersReady")
MANAGED_BY = ("kubeflow.org/mpi-operator", "kueue.x-k8s.io/multikueue")
NP_FLAGS = ("-np", "--np", "-n", "--n", "-c", "--num-proc")
_TYPE_EXAMPLES = {"integer": "a number without quotes, e.g. 2", "string": "a quoted string",
                  "boolean": "true or false", "object": "a mapping of keys", "array": "a list"}


@dataclass(frozen=True)
class Problem:
    """One finding: where (the object), the field path in it, what is wrong, and how to fix it."""

    where: str
    path: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.path}: {self.problem}; fix: {self.fix}"


def latest_version() -> str:
    """The newest Kubernetes version whose schemas kubernetes-validate ships: the one checked against by default."""
    return kubernetes_validate.utils.latest_version()


@cache
def schema() -> dict[str, Any]:
    """The strict MPIJob schema shipped with hvdcomp."""
    return json.loads(resources.files("hvdcomp.k8s").joinpath("mpijob.schema.json").read_text())


def field_path(parts: Iterable[Any]) -> str:
    """``spec.mpiReplicaSpecs.Worker.template.spec.containers[0].image`` from jsonschema's path parts."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(document)"


def explain(error: jsonschema.ValidationError, prefix: tuple[Any, ...] = ()) -> tuple[str, str, str]:
    """(path, problem, fix) for one schema error, in words a user can act on."""
    parts = (*prefix, *error.absolute_path)
    path = field_path(parts)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        valid = sorted(error.schema.get("properties", {}))
        unknown = [key for key in error.instance if key not in valid]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            others = f" (also unknown here: {', '.join(map(str, unknown[1:]))})" if unknown[1:] else ""
            return (field_path((*parts, key)), f"unknown field{others}",
                    f"{hint}remove it or fix its spelling; valid fields here: {', '.join(valid) or '(none)'}")
    if error.validator == "required":
        missing = re.match(r"'([^']*)'", error.message)
        key = missing.group(1) if missing else "?"
        return field_path((*parts, key)), "missing", f"add '{key}'"
    if error.validator == "type":
        wanted = error.validator_value if isinstance(error.validator_value, str) else " or ".join(error.validator_value)
        return path, f"{error.instance!r} is a {type(error.instance).__name__}, must be {wanted}", \
            f"write {_TYPE_EXAMPLES.get(wanted, wanted)}"
    if error.validator in ("enum", "const"):
        valid = error.validator_value if error.validator == "enum" else [error.validator_value]
        return path, f"{error.instance!r} is not supported", f"use {' or '.join(map(repr, valid))}"
    if error.validator == "pattern":
        return path, f"{error.instance!r} does not match {error.validator_value}", \
            "write a value of that form (a quantity: e.g. 4, 500m, 16Gi)"
    return path, error.message, "see the Kubernetes API reference for this field"


def schema_problems(document: Mapping[str, Any], where: str) -> list[Problem]:
    validator = jsonschema.Draft202012Validator(schema())
    return [Problem(where, *explain(error)) for error in sorted(validator.iter_errors(document), key=str)]


def kubernetes_problems(document: Mapping[str, Any], where: str, version: str,
                        prefix: tuple[Any, ...] = ()) -> list[Problem]:
    """Kubernetes' own strict schema (kubernetes-validate reports the first error of a document)."""
    try:
        kubernetes_validate.validate(dict(document), version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [Problem(where, *explain(error, prefix))]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [Problem(where, "kind", error.message, "hvdcomp k8s validate checks MPIJobs and core objects")]
    return []


def _containers(template: Any) -> list[Mapping[str, Any]]:
    spec = template.get("spec", {}) if isinstance(template, Mapping) else {}
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    return [c for c in containers if isinstance(c, Mapping)] if isinstance(containers, list) else []


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command, args and env values: ``$$`` escapes, unknown names stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's literal env values, expanded in order as the kubelet does."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if isinstance(var, Mapping) and isinstance(var.get("value"), str):
            env[var["name"]] = expand(var["value"], env)
    return env


def launcher_argv(container: Mapping[str, Any]) -> list[str]:
    """The launcher container's argv (command + args, expanded); a ``sh -c SCRIPT`` is split into words."""
    env = container_env(container)
    argv = [expand(str(word), env) for word in [*(container.get("command") or []), *(container.get("args") or [])]]
    if len(argv) >= 3 and argv[0].rsplit("/", 1)[-1] in ("sh", "bash") and "-c" in argv:
        argv = shlex.split(argv[argv.index("-c") + 1])
    return argv


def launcher_np(argv: list[str]) -> tuple[str | None, str | None]:
    """(the launcher program, the value of its -np flag) in a launcher argv; None where absent."""
    for index, word in enumerate(argv):
        if word.rsplit("/", 1)[-1] in LAUNCHERS:
            rest = argv[index + 1:]
            for position, flag in enumerate(rest):
                if flag in NP_FLAGS and position + 1 < len(rest):
                    return word.rsplit("/", 1)[-1], rest[position + 1]
                if flag.split("=")[0] in NP_FLAGS and "=" in flag:
                    return word.rsplit("/", 1)[-1], flag.split("=", 1)[1]
            return word.rsplit("/", 1)[-1], None
    return None, None


def horovodrun_args(argv: list[str]) -> Any:
    """The arguments of horovodrun in a launcher argv (from the word naming it on), read by horovodrun's own parser;
    raises ValueError where it refuses them."""
    from horovod.runner import launch

    start = next(i for i, word in enumerate(argv) if word.rsplit("/", 1)[-1] == "horovodrun")
    with mock.patch.object(sys, "argv", ["horovodrun", *argv[start + 1:]]):
        try:
            return launch.parse_args()
        except SystemExit:
            raise ValueError(f"horovodrun rejects the launcher's arguments: {' '.join(argv[start:])}") from None


def horovodrun_hosts(argv: list[str]) -> bool:
    """Whether horovodrun in a launcher argv is told its hosts (a hostfile, hosts or a host discovery script);
    without, it starts every rank on the launcher's own host. Arguments horovodrun refuses count as told (that
    problem is another's)."""
    try:
        args = horovodrun_args(argv)
    except ValueError:
        return True
    return bool(args.hostfile or args.hosts or args.host_discovery_script)


def _quantity_int(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def rule_problems(job: Mapping[str, Any], where: str) -> Iterator[Problem]:
    """The operator's rules beyond its schema ("operator"), then hvdcomp's ("hvdcomp"). Assumes a schema-valid job."""
    spec = job["spec"]
    specs = spec["mpiReplicaSpecs"]
    launcher, worker = specs.get("Launcher"), specs.get("Worker")
    base = "spec.mpiReplicaSpecs"
    # --- the operator's controller
    if launcher is None:
        yield Problem(where, f"{base}.Launcher", "missing (operator: exactly one launcher)",
                      "add a Launcher replica spec with replicas: 1")
    elif launcher.get("replicas", 1) != 1:  # (the operator's defaults: 1 launcher, 0 workers)
        yield Problem(where, f"{base}.Launcher.replicas", f"{launcher['replicas']} (operator: must be 1)",
                      "set replicas: 1")
    if worker is None:
        yield Problem(where, f"{base}.Worker", "missing (hvdcomp: at least one worker)",
                      "add a Worker replica spec with replicas >= 1")
    elif worker.get("replicas", 0) < 1:
        yield Problem(where, f"{base}.Worker.replicas", f"{worker.get('replicas', '0 (the default)')} (hvdcomp: "
                      "must be >= 1)", "set replicas to the number of nodes")
    for role, replica in (("Launcher", launcher), ("Worker", worker)):
        if replica is None:
            continue
        policy = replica.get("restartPolicy")
        if policy is not None and policy not in RESTART_POLICIES:
            yield Problem(where, f"{base}.{role}.restartPolicy", f"{policy!r} (operator: not supported)",
                          f"use {' or '.join(RESTART_POLICIES)}")
        if not _containers(replica["template"]):
            yield Problem(where, f"{base}.{role}.template.spec.containers", "empty (operator: at least one container)",
                          "add the container that runs the launcher command or sshd")
    run_policy = spec.get("runPolicy", {})
    clean = run_policy.get("cleanPodPolicy")
    if clean is not None and clean not in CLEAN_POD_POLICIES:
        yield Problem(where, "spec.runPolicy.cleanPodPolicy", f"{clean!r} (operator: not supported)",
                      f"use one of {', '.join(CLEAN_POD_POLICIES)}")
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if run_policy.get(key, 0) < 0:
            yield Problem(where, f"spec.runPolicy.{key}", f"{run_policy[key]} (operator: must be >= 0)",
                          "use a non-negative number")
    if run_policy.get("managedBy") not in (None, *MANAGED_BY):
        yield Problem(where, "spec.runPolicy.managedBy", f"{run_policy['managedBy']!r} (operator: not supported)",
                      f"use {' or '.join(MANAGED_BY)}, or leave it out")
    if spec.get("sshAuthMountPath") == "":
        yield Problem(where, "spec.sshAuthMountPath", "empty (operator: required)",
                      "give the ssh directory of the image's user, e.g. /home/mpiuser/.ssh")
    elif spec.get("sshAuthMountPath") is None and (user := _non_root_user(worker)) is not None:
        yield Problem(where, "spec.sshAuthMountPath", f"not set: the operator mounts the ssh keys at /root/.ssh, where "
                      f"the workers' sshd, running as user {user}, finds no host key and exits (the launcher then "
                      "never starts)", "give that user's ssh directory, e.g. /home/mpiuser/.ssh (hvdcomp's image)")
    creation = spec.get("launcherCreationPolicy")
    if creation is not None and creation not in LAUNCHER_CREATION_POLICIES:
        yield Problem(where, "spec.launcherCreationPolicy", f"{creation!r} (operator: not supported)",
                      f"use {' or '.join(LAUNCHER_CREATION_POLICIES)}")
    replicas = worker.get("replicas", 0) if worker is not None else 1
    name = job["metadata"]["name"]
    pod = f"{name}-worker-{max(replicas, 1) - 1}"
    if len(pod) > 63 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", pod):
        yield Problem(where, "metadata.name", f"the last worker pod's name {pod!r} is not a DNS-1035 label "
                      "(operator: lower-case letters, digits, '-', starting with a letter, at most 63 characters)",
                      "use a shorter lower-case name that starts with a letter")
    # --- hvdcomp's rules
    slots = spec.get("slotsPerWorker")
    if slots is None:
        yield Problem(where, "spec.slotsPerWorker", "not set (hvdcomp: the operator's default 1 is rarely meant)",
                      "set it to the GPUs per worker (one rank per GPU), or the ranks per CPU worker")
    elif slots < 1:
        yield Problem(where, "spec.slotsPerWorker", f"{slots} (hvdcomp: must be >= 1)",
                      "set it to the ranks per worker")
    for key in ("cleanPodPolicy", "backoffLimit", "ttlSecondsAfterFinished"):
        if key not in run_policy:
            yield Problem(where, f"spec.runPolicy.{key}", "not set (hvdcomp: defaults keep pods or retry silently)",
                          {"cleanPodPolicy": "set Running (or All)", "backoffLimit": "set e.g. 0",
                           "ttlSecondsAfterFinished": "set e.g. 3600"}[key])
    if creation != "WaitForWorkersReady":
        yield Problem(where, "spec.launcherCreationPolicy", f"{creation or 'AtStartup (default)'} (hvdcomp: the "
                      "launcher may start before the workers resolve)", "set WaitForWorkersReady")
    for role, replica in (("Launcher", launcher), ("Worker", worker)):
        if replica is None:
            continue
        for index, container in enumerate(_containers(replica["template"])):
            yield from _container_problems(where, f"{base}.{role}.template.spec", index, container,
                                           replica["template"]["spec"], role == "Worker")
    worker_gpus = _gpus(worker) if worker is not None else 0
    if slots is not None and worker_gpus and slots != worker_gpus:
        yield Problem(where, "spec.slotsPerWorker", f"{slots} with {worker_gpus} GPUs per worker (hvdcomp: Horovod "
                      "runs one rank per GPU)", f"set slotsPerWorker: {worker_gpus}")
    if launcher is not None and (gpus := _gpus(launcher)):
        if not spec.get("runLauncherAsWorker"):
            yield Problem(where, f"{base}.Launcher.template.spec.containers", f"{gpus} GPUs on the launcher, which "
                          "only runs the launcher command (hvdcomp: they stay idle)",
                          f"remove {GPU} from the Launcher's resources")
        elif slots is not None and gpus != slots:
            yield Problem(where, f"{base}.Launcher.template.spec.containers", f"{gpus} GPUs on a launcher that is "
                          f"also a worker with slotsPerWorker {slots} (hvdcomp: one rank per GPU)",
                          f"give the Launcher {slots} GPUs, as each worker")
    elif launcher is not None and spec.get("runLauncherAsWorker") and worker_gpus:
        yield Problem(where, f"{base}.Launcher.template.spec.containers", "no GPUs on a launcher that is also a "
                      f"worker (runLauncherAsWorker), whose hostfile gives it {slots or 1} ranks (hvdcomp)",
                      f"give the Launcher {worker_gpus} GPUs, as each worker, or drop runLauncherAsWorker")
    if launcher is not None and worker is not None and slots is not None and _containers(launcher["template"]):
        hosts = replicas + (1 if spec.get("runLauncherAsWorker") else 0)
        expected = hosts * slots
        path = f"{base}.Launcher.template.spec.containers[0]"
        argv = launcher_argv(_containers(launcher["template"])[0])
        program, np = launcher_np(argv)
        if program is None:
            yield Problem(where, f"{path}.command", f"runs neither {' nor '.join(LAUNCHERS)} (hvdcomp)",
                          f"run 'horovodrun -np {expected} --hostfile /etc/mpi/hostfile ...' or "
                          f"'mpirun -np {expected} ...'")
        elif np is None:
            yield Problem(where, f"{path}.args", f"{program} has no -np (hvdcomp: the rank count must be explicit)",
                          f"add -np {expected} (workers x slotsPerWorker)")
        elif np != str(expected):
            yield Problem(where, f"{path}.args", f"-np {np}, but {hosts} hosts x slotsPerWorker {slots} = {expected} "
                          "(hvdcomp)", f"use -np {expected}, or change the worker replicas or slotsPerWorker")
        if program == "horovodrun" and not horovodrun_hosts(argv):
            yield Problem(where, f"{path}.args", "horovodrun names no hosts: it would start every rank in the "
                          "launcher's pod (its default, localhost) (hvdcomp)",
                          "add --hostfile /etc/mpi/hostfile (the operator's), before the training command")


def _gpus(replica: Mapping[str, Any]) -> int:
    """The GPUs a replica's pod asks for (its containers' limits)."""
    return sum(_quantity_int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) or 0
               for c in _containers(replica["template"]))


def _non_root_user(replica: Mapping[str, Any] | None) -> int | None:
    """The user id other than root that a replica's first container runs as (its own securityContext, else its
    pod's), or None."""
    if replica is None or not _containers(replica["template"]):
        return None
    pod = (replica["template"].get("spec") or {}).get("securityContext") or {}
    container = _containers(replica["template"])[0].get("securityContext") or {}
    user = container.get("runAsUser", pod.get("runAsUser"))
    return user if isinstance(user, int) and user != 0 else None


def _container_problems(where: str, spec_path: str, index: int, container: Mapping[str, Any],
                        pod: Mapping[str, Any], worker: bool) -> Iterator[Problem]:
    path = f"{spec_path}.containers[{index}]"
    resources_ = container.get("resources") or {}
    limits, requests = resources_.get("limits") or {}, resources_.get("requests") or {}
    if GPU in requests and GPU not in limits:
        yield Problem(where, f"{path}.resources.limits", f"no {GPU} while requests has {requests[GPU]} (hvdcomp: "
                      "GPUs are set in limits)", f"add {GPU}: {requests[GPU]} to limits")
    elif GPU in requests and str(requests[GPU]) != str(limits[GPU]):
        yield Problem(where, f"{path}.resources.requests.{GPU}", f"{requests[GPU]} differs from the limit "
                      f"{limits[GPU]} (hvdcomp: GPU requests must equal limits)", f"set both to {limits[GPU]}")
    for kind, values in (("requests", requests), ("limits", limits)):
        for key in ("cpu", "memory"):
            if key not in values:
                yield Problem(where, f"{path}.resources.{kind}.{key}", "not set (hvdcomp: requests and limits on "
                              "every container)", f"set resources.{kind}.{key}")
    if not worker:
        return
    volumes = {v.get("name"): v for v in pod.get("volumes") or [] if isinstance(v, Mapping)}
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"]
    if not mounts:
        yield Problem(where, f"{path}.volumeMounts", "no /dev/shm mount (hvdcomp: the 64 MB container default "
                      "breaks NCCL)", "mount an emptyDir with medium: Memory at /dev/shm")
    elif (volumes.get(mounts[0].get("name")) or {}).get("emptyDir", {}).get("medium") != "Memory":
        yield Problem(where, f"{spec_path}.volumes", f"the /dev/shm volume {mounts[0].get('name')!r} is not a "
                      "memory-backed emptyDir (hvdcomp)", "use emptyDir: {medium: Memory, sizeLimit: 16Gi}")
    if index == 0 and not container.get("readinessProbe"):
        yield Problem(where, f"{path}.readinessProbe", "not set (hvdcomp: WaitForWorkersReady needs workers to turn "
                      "Ready only once sshd listens)", "add readinessProbe: {tcpSocket: {port: 2222}}")


def document_problems(document: Any, where: str, version: str) -> list[Problem]:
    """Every problem in one YAML document."""
    if not isinstance(document, Mapping) or "kind" not in document or "apiVersion" not in document:
        return [Problem(where, "(document)", "not a Kubernetes object", "give apiVersion, kind and metadata")]
    if document["kind"] != "MPIJob":
        return kubernetes_problems(document, where, version) + list(job_file_problems(document, where))
    problems = schema_problems(document, where)
    specs = document.get("spec", {}).get("mpiReplicaSpecs", {}) if isinstance(document.get("spec"), Mapping) else {}
    for role, replica in (specs.items() if isinstance(specs, Mapping) else []):
        if isinstance(replica, Mapping) and isinstance(replica.get("template"), Mapping):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{role.lower()}"},
                            "template": replica["template"]}
            problems += kubernetes_problems(pod_template, where, version, ("spec", "mpiReplicaSpecs", role))
    if not problems:
        problems = list(rule_problems(document, where))
    return problems


def job_file_problems(document: Mapping[str, Any], where: str) -> Iterator[Problem]:
    """A ConfigMap's hvdcomp job file (key ``job.yaml``, as ``render`` writes it): valid YAML, and its compression
    config one that ``hvdcomp train`` accepts (a misspelled option would otherwise fail only in the pods)."""
    data = document.get("data")
    if document.get("kind") != "ConfigMap" or not isinstance(data, Mapping) or CONFIG_KEY not in data:
        return
    path = f"data.{CONFIG_KEY}"
    try:
        job = yaml.safe_load(str(data[CONFIG_KEY]))
    except yaml.YAMLError as error:
        yield Problem(where, path, f"not valid YAML: {error}", "fix the YAML syntax")
        return
    if not isinstance(job, Mapping):
        yield Problem(where, path, f"a job file must be a mapping of settings; got {type(job).__name__}",
                      "render it with 'hvdcomp k8s render'")
        return
    if "compression" in job:
        try:
            CompressionConfig.parse(job["compression"])
        except ValueError as error:
            yield Problem(where, f"{path}: compression", str(error), "correct the compression config")


def _name(document: Any) -> tuple[str, str, str] | None:
    """(kind, namespace, name) of a Kubernetes object; None where any is missing."""
    metadata = document.get("metadata") if isinstance(document, Mapping) else None
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("name"), str):
        return None
    return str(document.get("kind")), str(metadata.get("namespace", "default")), metadata["name"]


def clash_problems(documents: list[tuple[str, Any]]) -> Iterator[Problem]:
    """Objects named as the operator names what it creates for an MPIJob of the same namespace (its hostfile's
    ConfigMap ``<job>-config``, its ssh Secret, Service and launcher Job): the operator refuses to adopt them, and the
    job stops before any pod starts. ``documents``: (where, document) of every file checked."""
    jobs = sorted(named[1:] for _, document in documents if (named := _name(document)) and named[0] == "MPIJob")
    for where, document in documents:
        named = _name(document)
        if named is None or named[0] not in OPERATOR_OBJECTS:
            continue
        kind, namespace, name = named
        for job_namespace, job in jobs:
            if namespace == job_namespace and name == OPERATOR_OBJECTS[kind].format(job=job):
                yield Problem(where, "metadata.name", f"the operator creates the {kind} {name!r} for MPIJob {job!r} "
                              "and refuses one it did not create: the job would stop before any pod starts",
                              f"rename it (hvdcomp k8s render names its ConfigMap '{job}-compression')")


def validate_files(paths: list[str], version: str) -> list[Problem]:
    """Problems in every document of every file, and objects that take the names of those the operator creates."""
    problems: list[Problem] = []
    checked: list[tuple[str, Any]] = []
    for path in paths:
        with open(path) as stream:
            try:
                documents = [d for d in yaml.safe_load_all(stream) if d is not None]
            except yaml.YAMLError as error:
                problems.append(Problem(path, "(file)", f"not valid YAML: {error}", "fix the YAML syntax"))
                continue
        if not documents:
            problems.append(Problem(path, "(file)", "no YAML documents", "give a file with Kubernetes objects"))
        for document in documents:
            name = document.get("metadata", {}).get("name", "?") if isinstance(document, Mapping) else "?"
            kind = document.get("kind", "?") if isinstance(document, Mapping) else "?"
            problems += document_problems(document, f"{path}: {kind}/{name}", version)
            checked.append((f"{path}: {kind}/{name}", document))
    return problems + list(clash_problems(checked))
