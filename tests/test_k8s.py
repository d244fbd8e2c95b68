"""Kubernetes deployment (hvdcomp/k8s, k8s/): render, offline validation, the kustomize overlays, the Dockerfile,
and the dry run of the CPU smoke job on emulated hosts.

What covers what: every overlay's equivalent job description (k8s/overlays/*/job.yaml) is rendered and validated
here always; `kubectl kustomize` builds each overlay and must produce exactly the rendered objects where kubectl
is installed (skipped otherwise); the shipped strict schema is cross-checked against the operator's published
CRD in ../shared/data (skipped where absent), and the rendered manifests are also validated against that CRD's
own schema made strict (which includes its copy of the PodSpec schema).
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils
import pytest
import yaml

from hvdcomp.k8s import render, validate

REPO = Path(__file__).resolve().parents[1]
CRD = REPO.parent / "shared" / "data" / "kubeflow.org_mpijobs.yaml"
K8S = REPO / "k8s"
OVERLAYS = ("gpu-1node", "gpu-multinode", "cpu-smoke")
BIN = Path(sys.executable).parent
VERSION = kubernetes_validate.utils.latest_version()
#: Where the shipped schema deliberately differs from the CRD's structure (see its $comment).
NARROWED = {
    "": "status left out; metadata restricted to ObjectMeta fields",
    ".spec.mpiReplicaSpecs": "the map restricted to its two keys, Launcher and Worker",
    ".spec.mpiReplicaSpecs.*.template.spec": "a core/v1 PodSpec, checked by kubernetes-validate",
}


def crd_schema() -> dict[str, Any]:
    if not CRD.exists():
        pytest.skip(f"the operator's CRD is not at {CRD} (../shared/data is not part of this checkout)")
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v2beta1"]
    return version["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """The CRD's schema made strict: additionalProperties false wherever properties are listed."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    return [strict(item) for item in schema] if isinstance(schema, list) else schema


def documents(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}


def rendered(overlay: str) -> str:
    return render.render(render.load(str(K8S / "overlays" / overlay / "job.yaml")))


def mpijob(overlay: str = "gpu-multinode") -> dict[str, Any]:
    return documents(rendered(overlay))[("MPIJob", "hvdcomp")]


# ---- the strict schema against the operator's CRD


def test_schema_is_the_crd_made_strict() -> None:
    ours, theirs = validate.schema(), crd_schema()
    checked: list[str] = []

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        return ours["$defs"][node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node

    def walk(mine: dict[str, Any], crd: dict[str, Any], path: str) -> None:
        mine = resolve(mine)
        checked.append(path)
        if "anyOf" in crd:
            assert [a["type"] for a in mine["anyOf"]] == [a["type"] for a in crd["anyOf"]], path
            assert mine.get("pattern") == crd.get("pattern"), path
        else:
            assert mine.get("type") == crd.get("type"), f"{path}: type {mine.get('type')} != {crd.get('type')}"
        assert mine.get("format") == crd.get("format"), f"{path}: format"
        if "enum" in crd:
            assert mine.get("enum") == crd["enum"], f"{path}: enum"
        generic = re.sub(r"\.mpiReplicaSpecs\.(Launcher|Worker)\.", ".mpiReplicaSpecs.*.", path)
        if generic in NARROWED and path != "":
            if "properties" not in crd:  # a map narrowed to known keys: each key has the map's value schema
                for key, value in mine["properties"].items():
                    walk(value, crd["additionalProperties"], f"{path}.{key}")
            return
        if "properties" in mine:
            assert mine.get("additionalProperties") is False, f"{path}: not strict"
            missing = set(crd.get("properties", {})) - set(mine["properties"]) - ({"status"} if path == "" else set())
            assert not missing, f"{path}: fields the operator accepts are missing: {missing}"
            for key, value in mine["properties"].items():
                if path == "" and key == "metadata":
                    continue  # the CRD says only 'object': the API server checks ObjectMeta
                assert key in crd.get("properties", {}), f"{path}.{key}: not in the CRD"
                walk(value, crd["properties"][key], f"{path}.{key}")
        elif "additionalProperties" in crd and isinstance(crd["additionalProperties"], dict):
            walk(mine["additionalProperties"], crd["additionalProperties"], f"{path}.*")

    walk(ours, theirs, "")
    assert ".spec.runPolicy.schedulingPolicy.minResources.*" in checked
    assert ".spec.mpiReplicaSpecs.Worker.template.metadata.labels.*" in checked


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_pass_the_crds_own_schema(overlay: str) -> None:
    validator = jsonschema.Draft202012Validator(strict(crd_schema()))
    job = mpijob(overlay)
    assert not [error.message for error in validator.iter_errors(job)]
    job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    assert any("imagePulPolicy" in error.message for error in validator.iter_errors(job))


# ---- render, and the overlays' job descriptions


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_job_renders_a_valid_manifest(overlay: str, tmp_path: Path) -> None:
    job = render.load(str(K8S / "overlays" / overlay / "job.yaml"))
    path = tmp_path / "job.k8s.yaml"
    path.write_text(render.render(job))
    assert [str(p) for p in validate.validate_files([str(path)], VERSION)] == []
    manifest = mpijob(overlay)
    spec = manifest["spec"]
    workers, slots = spec["mpiReplicaSpecs"]["Worker"]["replicas"], spec["slotsPerWorker"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert validate.launcher_np(validate.launcher_argv(launcher)) == ("horovodrun", str(workers * slots))
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    resources = worker["resources"]
    assert resources["requests"] == resources["limits"]
    assert resources["limits"].get(render.GPU, 0) == job.gpus_per_node
    assert slots == (job.gpus_per_node or job.slots_per_worker)
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady" and worker["readinessProbe"]
    assert {"cleanPodPolicy", "backoffLimit", "ttlSecondsAfterFinished"} <= set(spec["runPolicy"])
    pod = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == render.USER_ID
    assert {"medium": "Memory", "sizeLimit": job.shm_size} in [v.get("emptyDir") for v in pod["volumes"]]


def test_expected_shapes_of_the_overlays() -> None:
    shapes = {o: (mpijob(o)["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"], mpijob(o)["spec"]["slotsPerWorker"])
              for o in OVERLAYS}
    assert shapes == {"gpu-1node": (1, 8), "gpu-multinode": (2, 8), "cpu-smoke": (2, 1)}


def test_base_manifest_is_the_render_of_its_job() -> None:
    expected = render.render(render.load(str(K8S / "base" / "job.yaml")))
    assert (K8S / "base" / "mpijob.yaml").read_text() == expected, \
        "k8s/base/mpijob.yaml is stale: hvdcomp k8s render --config k8s/base/job.yaml -o k8s/base/mpijob.yaml"


def test_config_map_carries_the_compression_config_for_hvdcomp_train(tmp_path: Path) -> None:
    from hvdcomp.config import CompressionConfig
    from hvdcomp.tools.train import load_job

    docs = documents(rendered("gpu-multinode"))
    path = tmp_path / render.CONFIG_KEY
    path.write_text(docs[("ConfigMap", "hvdcomp-compression")]["data"][render.CONFIG_KEY])
    job = load_job(str(path))  # what `hvdcomp train --config` reads
    assert job == {"compression": {"method": "terngrad", "options": {"clip": 2.5}}}
    CompressionConfig.parse(job["compression"])
    args = docs[("MPIJob", "hvdcomp")]["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert args["args"][args["args"].index("--config") + 1] == f"{render.CONFIG_DIR}/{render.CONFIG_KEY}"


def test_validate_checks_the_config_maps_compression_config(tmp_path: Path) -> None:
    """A manifest edited by hand (kustomize users): a misspelled option in the ConfigMap's job file is named by
    validate, not found in the pods."""
    path = tmp_path / "job.k8s.yaml"
    path.write_text(rendered("gpu-multinode").replace("clip: 2.5", "clipp: 2.5"))
    problems = validate.validate_files([str(path)], VERSION)
    assert [(p.where, p.path) for p in problems] == [
        (f"{path}: ConfigMap/hvdcomp-compression", "data.job.yaml: compression")], problems
    assert "clipp" in problems[0].problem
    path.write_text(rendered("gpu-multinode").replace("clip: 2.5", "clip: [2.5"))
    assert "not valid YAML" in validate.validate_files([str(path)], VERSION)[0].problem


def test_mpirun_launcher_exports_the_environment() -> None:
    job = render.Job.parse({"name": "j", "image": "i", "nodes": 3, "gpus_per_node": 4, "launcher": "mpirun",
                            "env": {"NCCL_DEBUG": "INFO"}})
    argv = render.launcher_command(job)
    assert argv[:3] == ["mpirun", "-np", "12"]
    exported = {argv[i + 1] for i, word in enumerate(argv) if word == "-x"}
    # sshd starts the ranks with its own environment: the driver's libraries are found through the launcher's
    assert {"PATH", "LD_LIBRARY_PATH", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "PYTHONUNBUFFERED"} <= exported
    cpu = render.launcher_command(render.Job.parse({"name": "j", "image": "i", "gpus_per_node": 0,
                                                    "launcher": "mpirun"}))
    assert "PATH" in cpu and "LD_LIBRARY_PATH" not in cpu  # (mpirun warns of one it cannot find)


def test_no_object_takes_a_name_the_operator_creates(tmp_path: Path) -> None:
    """The operator creates ``<job>-config`` (its hostfile), ``<job>-ssh``, the Service ``<job>`` and the Job
    ``<job>-launcher``, and stops a job whose names another object took: render's ConfigMap keeps clear of them, and
    validate names one that does not."""
    for overlay in OVERLAYS:
        docs = documents(rendered(overlay))
        job = next(name for kind, name in docs if kind == "MPIJob")
        taken = {(kind, form.format(job=job)) for kind, form in render.OPERATOR_OBJECTS.items()}
        assert not set(docs) & taken, (overlay, set(docs) & taken)
    good = tmp_path / "good.yaml"
    good.write_text(rendered("cpu-smoke"))
    assert validate.validate_files([str(good)], VERSION) == []
    clash = tmp_path / "clash.yaml"
    clash.write_text(rendered("cpu-smoke").replace("name: hvdcomp-compression", "name: hvdcomp-config"))
    problems = validate.validate_files([str(clash)], VERSION)
    assert [(p.where, p.path) for p in problems] == [(f"{clash}: ConfigMap/hvdcomp-config", "metadata.name")], problems
    assert "the operator creates the ConfigMap 'hvdcomp-config' for MPIJob 'hvdcomp'" in str(problems[0])
    other = tmp_path / "other-namespace.yaml"  # the same name in another namespace takes nothing of the job's
    other.write_text(clash.read_text().replace("namespace: default", "namespace: team", 1))
    assert not any(p.path == "metadata.name" for p in validate.validate_files([str(other)], VERSION))


@pytest.mark.parametrize(("description", "message"), [
    ({"image": "i"}, "name: missing"),
    ({"name": "Bad_Name", "image": "i"}, "name: 'Bad_Name' is not a DNS-1035 label"),
    ({"name": "j" * 54, "image": "i", "nodes": 12}, "has 64 characters; the operator refuses"),
    ({"name": "j", "image": "i", "gpus": 8}, "gpus: unknown key; fix: use one of name, namespace"),
    ({"name": "j", "image": "i", "nodes": 0}, "nodes: must be an integer >= 1"),
    ({"name": "j", "image": "i", "gpus_per_node": 8, "slots_per_worker": 4}, "slots_per_worker: 4 ranks per worker"),
    ({"name": "j", "image": "i", "launcher": "srun"}, "launcher: unknown launcher 'srun'; fix: use one of horovodrun"),
    ({"name": "j", "image": "i", "compression": {"method": "zip"}}, "compression: unknown compression method 'zip'"),
    ({"name": "j", "image": "i", "args": ["--compression", "fp16"]}, "args: '--compression' is set by render"),
    ({"name": "j", "image": "i", "resources": {"worker": {"cpu": "lots"}}}, "resources.worker.cpu: 'lots' is not"),
    ({"name": "j", "image": "i", "run_policy": {"clean_pod_policy": "Always"}}, "run_policy.clean_pod_policy"),
])
def test_render_rejects_a_bad_job_description(description: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        render.Job.parse(description)
    assert "; fix: " in str(error.value)


# ---- validate: each layer rejects what it should, naming the field and the fix


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def _launcher(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


BREAKAGES = [
    # the strict MPIJob schema
    (lambda j: j["spec"].update(slotsPerWorkers=8), "spec.slotsPerWorkers", "did you mean 'slotsPerWorker'"),
    (lambda j: j["spec"]["runPolicy"].update(backoffLimit="2"), "spec.runPolicy.backoffLimit", "must be integer"),
    (lambda j: j["spec"]["mpiReplicaSpecs"].update(Workers={}), "spec.mpiReplicaSpecs.Workers", "Launcher, Worker"),
    (lambda j: j.update(apiVersion="kubeflow.org/v1"), "apiVersion", "'kubeflow.org/v2beta1'"),
    # Kubernetes' own PodSpec schema, through kubernetes-validate
    (lambda j: _worker(j).update(imagePulPolicy="Always"),
     "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].imagePulPolicy", "did you mean 'imagePullPolicy'"),
    (lambda j: _worker(j)["ports"][0].update(containerPort="2222"),
     "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].ports[0].containerPort", "must be integer"),
    # the operator's controller
    (lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes"), "spec.runPolicy.cleanPodPolicy",
     "use one of All, Running, None"),
    (lambda j: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(replicas=2), "spec.mpiReplicaSpecs.Launcher.replicas",
     "set replicas: 1"),
    (lambda j: j["spec"]["mpiReplicaSpecs"]["Worker"].update(restartPolicy="Always"),
     "spec.mpiReplicaSpecs.Worker.restartPolicy", "Never or OnFailure"),
    (lambda j: j["spec"]["mpiReplicaSpecs"].pop("Worker"), "spec.mpiReplicaSpecs.Worker", "replicas >= 1"),
    (lambda j: j["metadata"].update(name="x" * 60), "metadata.name", "DNS-1035"),
    (lambda j: j["spec"]["runPolicy"].update(ttlSecondsAfterFinished=-1), "spec.runPolicy.ttlSecondsAfterFinished",
     "non-negative"),
    # hvdcomp's rules
    (lambda j: _worker(j)["resources"]["requests"].update({render.GPU: 4}),
     "containers[0].resources.requests.nvidia.com/gpu", "set both to 8"),
    (lambda j: _worker(j)["resources"]["requests"].pop("memory"), "containers[0].resources.requests.memory",
     "set resources.requests.memory"),
    (lambda j: _worker(j)["volumeMounts"].pop(), "Worker.template.spec.containers[0].volumeMounts",
     "emptyDir with medium: Memory at /dev/shm"),
    (lambda j: j["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"][1].update(emptyDir={}),
     "Worker.template.spec.volumes", "medium: Memory"),
    (lambda j: _launcher(j)["args"].__setitem__(1, "8"), "Launcher.template.spec.containers[0].args",
     "use -np 16"),
    (lambda j: j["spec"]["mpiReplicaSpecs"]["Worker"].update(replicas=3), "containers[0].args", "use -np 24"),
    (lambda j: j["spec"].update(slotsPerWorker=4), "spec.slotsPerWorker", "set slotsPerWorker: 8"),
    (lambda j: j["spec"]["runPolicy"].pop("cleanPodPolicy"), "spec.runPolicy.cleanPodPolicy", "set Running"),
    (lambda j: j["spec"].pop("launcherCreationPolicy"), "spec.launcherCreationPolicy", "set WaitForWorkersReady"),
    (lambda j: _worker(j).pop("readinessProbe"), "containers[0].readinessProbe", "tcpSocket"),
    (lambda j: _launcher(j).update(command=["python"], args=["train.py"]), "containers[0].command",
     "horovodrun -np 16"),
    (lambda j: _launcher(j)["args"].__delitem__(slice(2, 4)), "Launcher.template.spec.containers[0].args",
     "add --hostfile /etc/mpi/hostfile"),
    # the operator mounts the keys at /root/.ssh by default, where a non-root sshd finds none
    (lambda j: j["spec"].pop("sshAuthMountPath"), "spec.sshAuthMountPath", "/home/mpiuser/.ssh"),
    (lambda j: _launcher(j)["resources"]["limits"].update({render.GPU: 8}), "Launcher.template.spec.containers",
     "remove nvidia.com/gpu from the Launcher's resources"),
    (lambda j: j["spec"].update(runLauncherAsWorker=True), "Launcher.template.spec.containers",
     "give the Launcher 8 GPUs"),
]


@pytest.mark.parametrize(("breakage", "path", "fix"), BREAKAGES)
def test_validate_names_the_field_and_the_fix(breakage: Any, path: str, fix: str) -> None:
    job = copy.deepcopy(mpijob("gpu-multinode"))
    breakage(job)
    problems = validate.document_problems(job, "MPIJob/hvdcomp", VERSION)
    assert problems, "the broken manifest was accepted"
    assert any(path in p.path and fix in str(p) and p.fix for p in problems), "\n".join(map(str, problems))


def test_a_job_file_that_is_not_yaml_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hvdcomp import cli

    bad = tmp_path / "job.yaml"
    bad.write_text("name: j\nimage: [i\n")
    assert cli.main(["k8s", "render", "--config", str(bad)]) == 2
    assert f'hvdcomp k8s: error: not valid YAML: while parsing a flow sequence\n  in "{bad}", line 2' in \
        capsys.readouterr().err


def test_validate_accepts_what_the_operator_accepts() -> None:
    """horovodrun's --num-proc for -np; a Launcher without replicas (the operator's default: 1)."""
    job = copy.deepcopy(mpijob("gpu-multinode"))
    _launcher(job)["args"][0] = "--num-proc"
    assert _launcher(job)["args"][:2] == ["--num-proc", "16"]
    del job["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"]
    assert validate.document_problems(job, "MPIJob/hvdcomp", VERSION) == []
    del job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]  # the operator's default: 0 workers
    assert [p.path for p in validate.document_problems(job, "MPIJob/hvdcomp", VERSION)][:1] == [
        "spec.mpiReplicaSpecs.Worker.replicas"]


def test_validate_command_line(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(rendered("cpu-smoke"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("cleanPodPolicy: Running", "cleanPodPolicy: Sometimes"))
    ok = subprocess.run([BIN / "hvdcomp", "k8s", "validate", good], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "0 problem(s)" in ok.stdout
    failed = subprocess.run([BIN / "hvdcomp", "k8s", "validate", good, bad], capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 1
    assert f"{bad}: MPIJob/hvdcomp: spec.runPolicy.cleanPodPolicy: 'Sometimes'" in failed.stderr
    assert "fix: use one of All, Running, None" in failed.stderr


def test_render_command_line_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "smoke.yaml"
    done = subprocess.run([BIN / "hvdcomp", "k8s", "render", "--config", K8S / "overlays" / "cpu-smoke" / "job.yaml",
                           "-o", out], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == rendered("cpu-smoke")
    bad = tmp_path / "bad-job.yaml"
    bad.write_text("name: j\nimage: i\nnodes: two\n")
    failed = subprocess.run([BIN / "hvdcomp", "k8s", "render", "--config", bad], capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 2
    assert "nodes: must be an integer >= 1, got 'two'; fix:" in failed.stderr


# ---- kustomize


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_builds_each_overlay_as_render_does(overlay: str, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays are checked through their job.yaml only")
    built = subprocess.run([kubectl, "kustomize", K8S / "overlays" / overlay], capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr
    assert documents(built.stdout) == documents(rendered(overlay)), \
        f"k8s/overlays/{overlay}/kustomization.yaml and job.yaml describe different jobs"
    path = tmp_path / "built.yaml"
    path.write_text(built.stdout)
    assert [str(p) for p in validate.validate_files([str(path)], VERSION)] == []


# ---- the Dockerfile, statically (no Docker engine here)


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in (K8S / "Dockerfile").read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def test_dockerfile_copies_only_paths_that_exist_and_are_in_the_context() -> None:
    ignore = (K8S / "Dockerfile.dockerignore").read_text().splitlines()
    included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    sources = []
    for instruction, arguments in dockerfile():
        if instruction == "COPY" and "--from=" not in arguments:
            words = [w for w in shlex.split(arguments) if not w.startswith("--")]
            sources += words[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such path in the checkout"
        assert source.rstrip("/") in included, f"COPY {source}: excluded by k8s/Dockerfile.dockerignore"


def test_dockerfile_builds_with_the_tested_setup_script() -> None:
    runs = [arguments for instruction, arguments in dockerfile() if instruction == "RUN"]
    assert any(re.search(r"\bbash launch/setup\.sh\b", run) for run in runs)
    # the script the tests themselves run under (launch/test.sh, CI's entry point) is the same file
    assert "bash launch/setup.sh" in (REPO / "launch" / "test.sh").read_text()
    assert any("horovodrun --check-build" in run and r"\[X\] NCCL" in run for run in runs)


def test_dockerfile_image_layout_matches_the_manifests() -> None:
    steps = dockerfile()
    images = [arguments.split()[0] for instruction, arguments in steps if instruction == "FROM"]
    assert images == ["nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU}", "nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}"]
    final = steps[max(i for i, (instruction, _) in enumerate(steps) if instruction == "FROM"):]
    final_runs = " ".join(arguments for instruction, arguments in final if instruction == "RUN")
    for package in ("openssh-server", "openmpi-bin", "python3", "python3-dev", "gcc"):
        assert re.search(rf"\s{package}\s", final_runs), package
    assert "#include <Python.h>" in final_runs, "the image checks that Triton's launcher compiles"
    assert f"useradd -m -u {render.USER_ID}" in final_runs
    users = [arguments for instruction, arguments in final if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("WORKDIR", render.IMAGE_ROOT) in steps
    assert any(instruction == "ENV" and f"PATH={render.IMAGE_ROOT}/.venv/bin:" in arguments
               for instruction, arguments in final)
    assert "Port 2222" in final_runs  # the ssh client's port, as sshd's
    sshd = (K8S / "sshd_config").read_text()
    assert f"Port {render.SSH_PORT}" in sshd
    assert f"HostKey {render.SSH_AUTH_MOUNT_PATH}/id_rsa" in sshd
    worker = _worker(mpijob("cpu-smoke"))
    assert [*worker["command"], *worker["args"]] == ["/usr/sbin/sshd", "-De", "-f", render.SSHD_CONFIG]
    assert ("COPY", f"--chown=mpiuser:mpiuser k8s/sshd_config {render.SSHD_CONFIG}") in steps


# ---- dry run


def test_dry_run_of_the_cpu_smoke_job_trains(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("the dry run creates network namespaces: needs root, ip and tc")
    probe = subprocess.run(["ip", "netns", "add", "hvdck8sprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces cannot be created here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", "hvdck8sprobe"], check=True)
    manifest = tmp_path / "smoke.yaml"
    built = subprocess.run([shutil.which("kubectl"), "kustomize", K8S / "overlays" / "cpu-smoke"],
                           capture_output=True, text=True) if shutil.which("kubectl") else None
    manifest.write_text(built.stdout if built and built.returncode == 0 else rendered("cpu-smoke"))
    done = subprocess.run([BIN / "hvdcomp", "k8s", "dry-run", manifest, "--timeout", "400"],
                          capture_output=True, text=True, timeout=500)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "hvdcomp-worker-0.hvdcomp.default.svc slots=1" in output
    summaries = [line for line in output.splitlines() if line.lstrip().startswith('[{"method"')]
    assert summaries, output[-5000:]
    summary = yaml.safe_load(summaries[-1].lstrip())[0]
    assert summary["method"] == "terngrad" and summary["ranks"] == 2 and summary["workload"] == "digits"
    assert summary["steps"] > 0 and summary["final_loss"] < 2.3 and summary["test_accuracy"] > 0.3  # chance: 0.1


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_dry_run_prepares_what_the_operator_would(launcher: str, tmp_path: Path) -> None:
    from hvdcomp.k8s import dryrun

    job = render.load(str(K8S / "overlays" / "cpu-smoke" / "job.yaml"))
    docs = list(yaml.safe_load_all(render.render(render.Job.parse({
        **yaml.safe_load((K8S / "overlays" / "cpu-smoke" / "job.yaml").read_text()), "launcher": launcher}))))
    launch, _, hosts = dryrun.prepare(docs, tmp_path)
    assert (launch.program, launch.np, hosts, launch.controller) == (launcher, 2, 2, "mpi")
    assert Path(launch.hostfile).read_text() == ("hvdcomp-worker-0.hvdcomp.default.svc slots=1\n"
                                                 "hvdcomp-worker-1.hvdcomp.default.svc slots=1\n")
    # Elastic Horovod's discovery script, as the operator writes it: one host a line, no slots (horovodrun --slots)
    assert (Path(launch.hostfile).parent / "discover_hosts.sh").read_text() == (
        "#!/bin/sh\necho hvdcomp-worker-0.hvdcomp.default.svc\necho hvdcomp-worker-1.hvdcomp.default.svc\n")
    config = Path(launch.command[launch.command.index("--config") + 1])
    assert config.is_relative_to(tmp_path) and yaml.safe_load(config.read_text())["compression"] == job.compression
    assert launch.command[:2] == ["hvdcomp", "train"] and launch.command[-1] == "--no-progress"
    assert launch.env["NCCL_SOCKET_IFNAME"] == "eth0" and launch.env["NCCL_DEBUG"] == "WARN"
    assert launch.env["PATH"].startswith(f"{REPO / '.venv' / 'bin'}:")
    if launcher == "horovodrun":
        assert launch.env["OMPI_MCA_btl_tcp_if_include"] == "eth0"  # horovodrun passes its whole environment on


def test_dry_run_refuses_what_it_cannot_emulate(tmp_path: Path) -> None:
    from hvdcomp.k8s import dryrun

    with pytest.raises(ValueError, match="slotsPerWorker is 8: the emulated cluster runs one rank per host"):
        dryrun.prepare(list(yaml.safe_load_all(rendered("gpu-1node"))), tmp_path / "a")
    docs = list(yaml.safe_load_all(rendered("cpu-smoke")))
    _launcher(docs[1])["args"][1] = "3"
    with pytest.raises(ValueError, match="-np 3 but 2 hosts x 1 slots"):
        dryrun.prepare(docs, tmp_path / "b")
    docs = list(yaml.safe_load_all(rendered("cpu-smoke")))
    with pytest.raises(ValueError, match="mounts the ConfigMap 'hvdcomp-compression' at /etc/hvdcomp, but the"):
        dryrun.prepare(docs[1:], tmp_path / "c")
