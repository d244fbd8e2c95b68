"""Render a Kubeflow MPI Operator ``MPIJob`` (``kubeflow.org/v2beta1``) and its ConfigMap from a job description.

    hvdcomp k8s render --config k8s-job.yaml > job.k8s.yaml

The job description (every key optional except ``name`` and ``image``)::

    name: hvdcomp-terngrad          # the MPIJob's name; pods are <name>-launcher and <name>-worker-<i>
    namespace: default
    image: registry.example.com/hvdcomp:0.1.0   # built from k8s/Dockerfile
    nodes: 2                        # worker pods, one per node
    gpus_per_node: 8                # nvidia.com/gpu per worker; one rank per GPU; 0: a CPU-only job
    slots_per_worker: 8             # ranks per worker: must equal gpus_per_node (default), or any >= 1 for CPU
    launcher: horovodrun            # horovodrun | mpirun
    script: hvdcomp train           # the training entry point (a string or a list); run on every rank
    args: [--workload, synthetic]   # the script's arguments
    compression: {method: terngrad} # hvdcomp's compression config (see hvdcomp/config.py)
    resources:                      # requests = limits (Guaranteed QoS); the GPUs come from gpus_per_node
      worker: {cpu: "32", memory: 256Gi}
      launcher: {cpu: "1", memory: 2Gi}
    shm_size: 16Gi                  # the memory-backed /dev/shm of each worker (NCCL needs more than 64 MB)
    network_interface: eth0         # NCCL_SOCKET_IFNAME and Open MPI's btl/oob_tcp_if_include; null: autodetect
    env: {NCCL_DEBUG: WARN}         # extra environment of the launcher, which passes it on to every rank
    run_policy: {clean_pod_policy: Running, backoff_limit: 0, ttl_seconds_after_finished: 3600,
                 active_deadline_seconds: null}

The compression config travels in a ConfigMap (``<name>-compression``; ``<name>-config`` is the operator's own, with
the hostfile), key ``job.yaml``, in the format of
``hvdcomp train --config``) mounted at ``/etc/hvdcomp`` in every pod; the script gets ``--config
/etc/hvdcomp/job.yaml`` before its own arguments. The launcher runs ``horovodrun -np N --hostfile
/etc/mpi/hostfile`` (or ``mpirun -np N``, whose default hostfile the operator sets) with N = nodes x slots;
workers run ``sshd`` as the image's non-root user on port 2222 (the operator's non-root layout), with a TCP
readiness probe so that ``launcherCreationPolicy: WaitForWorkersReady`` starts the launcher only once every
worker accepts ssh. Fields follow the MPI Operator's API (github.com/kubeflow/mpi-operator,
pkg/apis/kubeflow/v2beta1) and its examples (examples/v2beta1/pi/pi.yaml, nccl-tests).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from hvdcomp.config import CompressionConfig

API_VERSION = "kubeflow.org/v2beta1"
#: Where the image keeps the checkout (k8s/Dockerfile's WORKDIR) and its virtual environment.
IMAGE_ROOT = "/opt/hvdcomp"
#: The image's non-root user (k8s/Dockerfile) and where the operator mounts its ssh keys for it.
USER_ID = 1000
SSH_AUTH_MOUNT_PATH = "/home/mpiuser/.ssh"
SSHD_CONFIG = "/home/mpiuser/.sshd_config"
SSH_PORT = 2222
#: The operator's hostfile ConfigMap mount, and ours.
HOSTFILE = "/etc/mpi/hostfile"
CONFIG_DIR = "/etc/hvdcomp"
CONFIG_KEY = "job.yaml"
#: The objects the operator creates for an MPIJob named ``{job}`` (pkg/controller/mpi_job_controller.go): one of
#: these names taken by another object stops the job before any pod starts ("already exists and is not managed by
#: MPIJob"). Pods are ``{job}-launcher-*`` and ``{job}-worker-<i>``.
OPERATOR_OBJECTS = {"ConfigMap": "{job}-config", "Secret": "{job}-ssh", "Service": "{job}", "Job": "{job}-launcher"}
#: The one knob for the network interface; NCCL's and Open MPI's settings refer to it as $(...).
INTERFACE_VAR = "HVDCOMP_NETWORK_INTERFACE"
GPU = "nvidia.com/gpu"
LAUNCHERS = ("horovodrun", "mpirun")
CLEAN_POD_POLICIES = ("All", "Running", "None")
#: Kubernetes' resource quantity (the CRD's pattern for quantities).
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
#: The script's flags that render sets itself.
RESERVED_ARGS = ("--config", "--compression")

_KEYS = ("name", "namespace", "image", "nodes", "gpus_per_node", "slots_per_worker", "launcher", "script", "args",
         "compression", "resources", "shm_size", "network_interface", "env", "run_policy")
_RESOURCE_KEYS = ("worker", "launcher")
_QUANTITY_KEYS = ("cpu", "memory")
_RUN_POLICY_KEYS = ("clean_pod_policy", "backoff_limit", "ttl_seconds_after_finished", "active_deadline_seconds")


def _fail(path: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{path}: {problem}; fix: {fix}")


def _check_keys(path: str, given: Any, valid: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(given, Mapping):
        raise _fail(path, f"must be a mapping, got {type(given).__name__}", f"write keys among {', '.join(valid)}")
    for key in given:
        if key not in valid:
            raise _fail(f"{path}.{key}" if path else str(key), "unknown key", f"use one of {', '.join(valid)}")
    return given


def _int(path: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, f"must be an integer >= {minimum}, got {value!r}", f"write e.g. {max(minimum, 1)}")
    return value


def _quantity(path: str, value: Any) -> str:
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not QUANTITY.match(text):
        raise _fail(path, f"{value!r} is not a Kubernetes quantity", "write e.g. 4, 500m, 16Gi")
    return text


def _dns1035(path: str, value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", value):
        raise _fail(path, f"{value!r} is not a DNS-1035 label",
                    "use lower-case letters, digits and '-', starting with a letter")
    return value


@dataclass(frozen=True)
class Job:
    """A validated job description (see the module docstring)."""

    name: str
    image: str
    namespace: str = "default"
    nodes: int = 1
    gpus_per_node: int = 8
    slots_per_worker: int = 8
    launcher: str = "horovodrun"
    script: tuple[str, ...] = ("hvdcomp", "train")
    args: tuple[str, ...] = ()
    compression: Any = "terngrad"
    worker_resources: dict[str, str] = field(default_factory=dict)
    launcher_resources: dict[str, str] = field(default_factory=lambda: {"cpu": "1", "memory": "2Gi"})
    shm_size: str = "16Gi"
    network_interface: str | None = "eth0"
    env: dict[str, str] = field(default_factory=dict)
    clean_pod_policy: str = "Running"
    backoff_limit: int = 0
    ttl_seconds_after_finished: int = 3600
    active_deadline_seconds: int | None = None

    @property
    def np(self) -> int:
        """Ranks: one per slot of every worker (the operator writes ``slots=slotsPerWorker`` per worker)."""
        return self.nodes * self.slots_per_worker

    @classmethod
    def parse(cls, description: Any) -> Job:
        """Checks every key and value; errors name the key path and the fix."""
        given = _check_keys("", description, _KEYS)
        for key in ("name", "image"):
            if key not in given:
                raise _fail(key, "missing", f"add '{key}:' to the job description")
        name = _dns1035("name", given["name"])
        if not isinstance(given["image"], str) or not given["image"].strip():
            raise _fail("image", f"must be an image reference, got {given['image']!r}",
                        "write e.g. registry.example.com/hvdcomp:0.1.0 (built from k8s/Dockerfile)")
        namespace = _dns1035("namespace", given.get("namespace", "default"))
        nodes = _int("nodes", given.get("nodes", 1), 1)
        if len(last := f"{name}-worker-{nodes - 1}") > 63:
            raise _fail("name", f"the last worker pod's name {last!r} has {len(last)} characters; the operator "
                        "refuses names of pods over 63", f"use a name of at most {63 - len(last) + len(name)} "
                        "characters")
        gpus = _int("gpus_per_node", given.get("gpus_per_node", 8), 0)
        slots = _int("slots_per_worker", given.get("slots_per_worker", gpus or 1), 1)
        if gpus and slots != gpus:
            raise _fail("slots_per_worker", f"{slots} ranks per worker with {gpus} GPUs: Horovod runs one rank per GPU",
                        f"set slots_per_worker to {gpus} or leave it out")
        launcher = given.get("launcher", "horovodrun")
        if launcher not in LAUNCHERS:
            raise _fail("launcher", f"unknown launcher {launcher!r}", f"use one of {', '.join(LAUNCHERS)}")
        script = given.get("script", "hvdcomp train")
        script = shlex.split(script) if isinstance(script, str) else script
        args = given.get("args", [])
        for key, value in (("script", script), ("args", args)):
            if not isinstance(value, list) or not all(isinstance(item, str | int | float) for item in value):
                raise _fail(key, f"must be a list of strings, got {value!r}", f"write e.g. {key}: [--epochs, '1']")
        if not script:
            raise _fail("script", "is empty", "write the training entry point, e.g. 'hvdcomp train'")
        for arg in map(str, args):
            if arg.split("=")[0] in RESERVED_ARGS:
                raise _fail("args", f"{arg!r} is set by render ({CONFIG_DIR}/{CONFIG_KEY}, from 'compression')",
                            "put the compression config under 'compression:' and remove it from args")
        compression = given.get("compression", "terngrad")
        try:
            CompressionConfig.parse(compression)
        except (ValueError, TypeError) as error:
            raise _fail("compression", str(error), "see hvdcomp/config.py for the keys and methods") from None
        resources = _check_keys("resources", given.get("resources", {}), _RESOURCE_KEYS)
        default_worker = {"cpu": "16", "memory": "128Gi"} if gpus else {"cpu": str(slots), "memory": f"{2 * slots}Gi"}
        parsed_resources = {}
        for kind, default in (("worker", default_worker), ("launcher", {"cpu": "1", "memory": "2Gi"})):
            values = _check_keys(f"resources.{kind}", resources.get(kind, {}), _QUANTITY_KEYS)
            parsed_resources[kind] = {key: _quantity(f"resources.{kind}.{key}", values.get(key, default[key]))
                                      for key in _QUANTITY_KEYS}
        interface = given.get("network_interface", "eth0")
        if interface is not None and (not isinstance(interface, str) or not interface):
            raise _fail("network_interface", f"must be an interface name or null, got {interface!r}",
                        "write e.g. eth0 (the pod network), or null to let NCCL and Open MPI choose")
        env = given.get("env", {})
        if not isinstance(env, Mapping):
            raise _fail("env", f"must be a mapping, got {type(env).__name__}", "write NAME: value pairs")
        for key, value in env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)) or not isinstance(value, str | int | float):
                raise _fail(f"env.{key}", f"{key}={value!r} is not a NAME: value pair",
                            "write NAME: value with a plain value (quote numbers if you like)")
        policy = _check_keys("run_policy", given.get("run_policy", {}), _RUN_POLICY_KEYS)
        clean = policy.get("clean_pod_policy", "Running")
        if clean not in CLEAN_POD_POLICIES:
            raise _fail("run_policy.clean_pod_policy", f"unknown policy {clean!r}",
                        f"use one of {', '.join(CLEAN_POD_POLICIES)}")
        deadline = policy.get("active_deadline_seconds")
        return cls(
            name=name, image=given["image"], namespace=namespace, nodes=nodes, gpus_per_node=gpus,
            slots_per_worker=slots, launcher=launcher, script=tuple(map(str, script)), args=tuple(map(str, args)),
            compression=compression, worker_resources=parsed_resources["worker"],
            launcher_resources=parsed_resources["launcher"],
            shm_size=_quantity("shm_size", given.get("shm_size", "16Gi" if gpus else "1Gi")),
            network_interface=interface, env={str(k): str(v) for k, v in env.items()}, clean_pod_policy=clean,
            backoff_limit=_int("run_policy.backoff_limit", policy.get("backoff_limit", 0), 0),
            ttl_seconds_after_finished=_int("run_policy.ttl_seconds_after_finished",
                                            policy.get("ttl_seconds_after_finished", 3600), 0),
            active_deadline_seconds=None if deadline is None else _int("run_policy.active_deadline_seconds",
                                                                       deadline, 1))


def config_map_name(job: Job) -> str:
    """The compression config's ConfigMap: not ``<name>-config``, which the operator creates for its hostfile and
    refuses to share (:data:`OPERATOR_OBJECTS`)."""
    return f"{job.name}-compression"


def _env(job: Job) -> list[dict[str, str]]:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if job.network_interface is not None:
        ref = f"$({INTERFACE_VAR})"
        env += [{"name": INTERFACE_VAR, "value": job.network_interface},
                {"name": "NCCL_SOCKET_IFNAME", "value": ref},
                {"name": "OMPI_MCA_btl_tcp_if_include", "value": ref},
                {"name": "OMPI_MCA_oob_tcp_if_include", "value": ref}]
    return env + [{"name": key, "value": value} for key, value in job.env.items()]


def launcher_command(job: Job) -> list[str]:
    """The launcher's argv: N = nodes x slots ranks of the script, with the compression config's path."""
    script = [*job.script, "--config", f"{CONFIG_DIR}/{CONFIG_KEY}", *job.args]
    if job.launcher == "horovodrun":
        interface = ["--network-interfaces", f"$({INTERFACE_VAR})"] if job.network_interface is not None else []
        return ["horovodrun", "-np", str(job.np), "--hostfile", HOSTFILE, *interface, *script]
    # mpirun takes the operator's default hostfile (OMPI_MCA_orte_default_hostfile); -x exports to the ranks.
    exported = [name for var in _env(job) if (name := var["name"]) != INTERFACE_VAR and not name.startswith("OMPI_")]
    # ranks start under sshd, with its environment: PATH, and on GPU nodes LD_LIBRARY_PATH (where the node's NVIDIA
    # driver is found: the CUDA image's /usr/local/nvidia/lib64 on some clouds), come from the launcher, as the
    # operator's Horovod example passes them
    paths = ("PATH", "LD_LIBRARY_PATH") if job.gpus_per_node else ("PATH",)
    flags = [flag for name in (*paths, *exported) for flag in ("-x", name)]
    return ["mpirun", "-np", str(job.np), "--bind-to", "none", "--map-by", "slot", *flags, *script]


def _resources(values: Mapping[str, str], gpus: int) -> dict[str, dict[str, Any]]:
    limits: dict[str, Any] = dict(values)
    if gpus:
        limits[GPU] = gpus
    return {"requests": dict(limits), "limits": limits}


def _pod(job: Job, container: dict[str, Any], volumes: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app.kubernetes.io/name": "hvdcomp", "app.kubernetes.io/instance": job.name,
                                "app.kubernetes.io/component": role},
                     # ssh between pods and NCCL's sockets must not go through a service-mesh proxy
                     "annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": {"securityContext": {"runAsUser": USER_ID, "runAsGroup": USER_ID, "runAsNonRoot": True},
                 "enableServiceLinks": False,
                 "containers": [{"name": role, "image": job.image, "imagePullPolicy": "IfNotPresent", **container}],
                 "volumes": volumes},
    }


def mpijob(job: Job) -> dict[str, Any]:
    config_volume = {"name": "hvdcomp-config", "configMap": {"name": config_map_name(job)}}
    config_mount = {"name": "hvdcomp-config", "mountPath": CONFIG_DIR, "readOnly": True}
    launcher = _pod(job, {"command": launcher_command(job)[:1], "args": launcher_command(job)[1:], "env": _env(job),
                          "resources": _resources(job.launcher_resources, 0), "volumeMounts": [config_mount]},
                    [config_volume], "launcher")
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}
    worker = _pod(job, {
        "command": ["/usr/sbin/sshd"], "args": ["-De", "-f", SSHD_CONFIG],
        "ports": [{"name": "ssh", "containerPort": SSH_PORT}],
        "readinessProbe": {"tcpSocket": {"port": SSH_PORT}, "initialDelaySeconds": 2, "periodSeconds": 2},
        "resources": _resources(job.worker_resources, job.gpus_per_node),
        "volumeMounts": [config_mount, {"name": "dshm", "mountPath": "/dev/shm"}],
    }, [config_volume, shm], "worker")
    run_policy: dict[str, Any] = {"cleanPodPolicy": job.clean_pod_policy, "backoffLimit": job.backoff_limit,
                                  "ttlSecondsAfterFinished": job.ttl_seconds_after_finished}
    if job.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = job.active_deadline_seconds
    return {
        "apiVersion": API_VERSION, "kind": "MPIJob",
        "metadata": {"name": job.name, "namespace": job.namespace, "labels": {"app.kubernetes.io/name": "hvdcomp"}},
        "spec": {
            "slotsPerWorker": job.slots_per_worker,
            "runPolicy": run_policy,
            "mpiImplementation": "OpenMPI",
            "launcherCreationPolicy": "WaitForWorkersReady",
            "sshAuthMountPath": SSH_AUTH_MOUNT_PATH,
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never", "template": launcher},
                "Worker": {"replicas": job.nodes, "restartPolicy": "Never", "template": worker},
            },
        },
    }


def config_map(job: Job) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": config_map_name(job), "namespace": job.namespace,
                         "labels": {"app.kubernetes.io/name": "hvdcomp"}},
            "data": {CONFIG_KEY: yaml.safe_dump({"compression": job.compression}, sort_keys=False)}}


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people and kubectl: no anchors/aliases, multi-line strings as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def dump(documents: list[dict[str, Any]]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False)


def render(job: Job) -> str:
    """The ConfigMap and the MPIJob as one YAML stream, ready for ``kubectl apply -f``."""
    return dump([config_map(job), mpijob(job)])


def load(path: str) -> Job:
    with open(path) as stream:
        description = yaml.safe_load(stream)
    try:
        return Job.parse(description if description is not None else {})
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
