"""launch/setup.sh's choice of Horovod build (HVDCOMP_HOROVOD_GPU_OPS), without building: the script is sourced (it
then only defines its functions) and install_horovod runs with stubs on the PATH (mpirun, nvidia-smi, nvcc) and a
stub python in the virtual environment, which answers torch's version and, for ``pip wheel``, records Horovod's build
variables and writes an empty wheel. build_horovod runs for real up to that call: the source release's checksum, the
unpacking and the patches (it needs the release in the cache that set-up filled)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

SDIST = Path(os.environ.get("HVDCOMP_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "hvdcomp") / "sdist" / "horovod-0.28.1.tar.gz"

PYTHON = """#!/bin/bash
case "$*" in
*"torch.version.cuda"*) echo "$FAKE_TORCH" ;;
*"sys.version_info"*) echo 3.12 ;;
*"nvidia.nccl"*) [[ -n $FAKE_NCCL ]] && echo "$FAKE_NCCL" || exit 1 ;;
*" wheel "*)
    env | grep '^HOROVOD_' | sort >>"$FAKE_LOG"
    while [[ $1 != -w ]]; do shift; done
    mkdir -p "$2" && touch "$2/horovod-0.28.1-cp312-cp312-linux_x86_64.whl" ;;
esac
"""


def install_horovod(tmp_path: Path, mode: str | None, torch: str, nvcc: str) -> tuple[str, str, set[str]]:
    """Sources set-up and calls install_horovod with stubs, nvcc on the PATH (``nvcc`` "path"), in HOROVOD_CUDA_HOME
    ("home") or nowhere (""); returns its output, the venv's name and the build's HOROVOD_* variables (empty where the
    wheel came from the cache)."""
    bin_dir, venv, cache = tmp_path / "bin", tmp_path / "venv", tmp_path / "cache"
    for folder in (bin_dir, venv / "bin", cache / "sdist", tmp_path / "nccl" / "include", tmp_path / "nccl" / "lib"):
        folder.mkdir(parents=True, exist_ok=True)
    (cache / "sdist" / SDIST.name).unlink(missing_ok=True)
    (cache / "sdist" / SDIST.name).symlink_to(SDIST)
    (tmp_path / "nccl" / "include" / "nccl.h").touch()
    (tmp_path / "nccl" / "lib" / "libnccl.so.2").touch()
    stubs = {venv / "bin" / "python": PYTHON, bin_dir / "mpirun": "#!/bin/sh\necho 'mpirun (Open MPI) 4.1.6'\n",
             bin_dir / "nvidia-smi": "#!/bin/sh\necho 9.0\n"}
    cuda_home = tmp_path / "cuda"
    if nvcc:
        (cuda_home / "bin").mkdir(parents=True, exist_ok=True)
        stubs[(bin_dir if nvcc == "path" else cuda_home / "bin") / "nvcc"] = "#!/bin/sh\nexit 0\n"
    for path, text in stubs.items():
        path.write_text(text)
        path.chmod(0o755)
    log = tmp_path / "build.log"
    log.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "HVDCOMP_CACHE": str(cache),
           "HVDCOMP_VENV": str(venv), "FAKE_TORCH": torch, "FAKE_NCCL": str(tmp_path / "nccl"), "FAKE_LOG": str(log),
           "HOROVOD_GPU_OPERATIONS": "NCCL",  # asked for by the environment: the key, not this, decides
           "HOROVOD_CUDA_HOME": str(cuda_home)}  # (not this machine's /usr/local/cuda)
    if mode is not None:
        env["HVDCOMP_HOROVOD_GPU_OPS"] = mode
    result = subprocess.run(["bash", "-c", f'source {REPO / "launch" / "setup.sh"} && echo "venv=$VENV_NAME" && '
                             "install_horovod"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    built = set(log.read_text().split()) if log.exists() else set()
    return result.stdout, re.search(r"^venv=(.*)$", result.stdout, re.MULTILINE).group(1), built


@pytest.mark.skipif(not SDIST.exists(), reason=f"no Horovod source release in the cache ({SDIST}): run set-up")
@pytest.mark.parametrize(("mode", "torch", "nvcc", "ops"), [
    ("none", "2.11.0+cu130 13.0", "path", "staged-sm90"),  # asked: no NCCL even with nvcc and an NCCL
    (None, "2.11.0+cu130 13.0", "path", "nccl-sm90"),  # the default: NCCL where it can
    (None, "2.11.0+cu130 13.0", "home", "nccl-sm90"),  # nvcc off the PATH, in the CUDA home: found
    ("auto", "2.11.0+cu130 13.0", "", "staged-sm90"),  # no nvcc: staged, as before
    ("none", "2.13.0+cpu ", "path", "cpu"),  # a CPU torch: the CPU build, whatever is asked
    (None, "2.13.0+cpu ", "", "cpu"),
])
def test_horovod_build_and_cache_key(tmp_path: Path, mode: str | None, torch: str, nvcc: str, ops: str) -> None:
    output, _, built = install_horovod(tmp_path, mode, torch, nvcc)
    keys = [path.name for path in (tmp_path / "cache" / "wheels").iterdir() if path.is_dir()]
    assert len(keys) == 1 and re.fullmatch(rf"horovod0\.28\.1-py3\.12-torch\S+-ompi4\.1\.6-{ops}-\w+", keys[0]), keys
    assert ("HOROVOD_GPU_OPERATIONS=NCCL" in built) == ops.startswith("nccl"), built
    assert ("HOROVOD_BUILD_CUDA_CC_LIST=90" in built) == ops.endswith("sm90"), built
    assert {"HOROVOD_WITH_PYTORCH=1", "HOROVOD_WITH_MPI=1", "HOROVOD_WITH_GLOO=1"} <= built, built
    if ops.startswith("staged"):
        assert "CUDA tensors staged through host memory" in output, output
    # a second set-up of the same kind takes the cached wheel
    output, _, built = install_horovod(tmp_path, mode, torch, nvcc)
    assert "Horovod wheel already built" in output and not built, output


@pytest.mark.parametrize(("mode", "venv"), [(None, ".venv"), ("auto", ".venv"), ("none", ".venv-staged")])
def test_virtual_environment_of_each_build(mode: str | None, venv: str) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(Path.home()),
           **({} if mode is None else {"HVDCOMP_HOROVOD_GPU_OPS": mode})}
    result = subprocess.run(["bash", "-c", f'source {REPO / "launch" / "setup.sh"} && echo "$VENV_NAME"'], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == venv, result.stdout + result.stderr


def test_unknown_gpu_ops_are_refused() -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(Path.home()), "HVDCOMP_HOROVOD_GPU_OPS": "nccl"}
    result = subprocess.run(["bash", str(REPO / "launch" / "setup.sh")], capture_output=True, text=True, timeout=60,
                            env=env)
    assert result.returncode == 1 and "valid values are auto and none" in result.stderr, result.stderr


@pytest.mark.parametrize("torch_requires_triton", [False, True])
def test_a_torch_with_its_own_triton_keeps_it(tmp_path: Path, torch_requires_triton: bool) -> None:
    """Beside a CPU torch the test extra's Triton (its interpreter) is installed with hvdcomp's extras in one pip
    call; beside a torch that requires a Triton of its own (PyPI's CUDA wheels pin theirs), the extra's pin would
    contradict it (pip: no resolution), so hvdcomp's requirements are installed by name without Triton."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    stub = f"""#!/bin/bash
case "$*" in
*'m.requires("torch")'*) exit {0 if torch_requires_triton else 1} ;;
*"importlib.metadata, os, re"*) printf 'pyyaml>=6\\nnumpy\\n' ;;
*"-m pip"*) echo "$*" >>"{log}" ;;
esac
"""
    (venv / "bin" / "python").write_text(stub)
    (venv / "bin" / "python").chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HVDCOMP_VENV": str(venv)}
    result = subprocess.run(["bash", "-c", f'source {REPO / "launch" / "setup.sh"} && install_hvdcomp false'],
                            env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    if torch_requires_triton:
        assert [c for c in calls if "-e ." in c] == [c for c in calls if c.endswith("--no-build-isolation -e .")], calls
        assert any(c.endswith("pyyaml>=6 numpy") for c in calls) and not any("triton" in c or "[" in c
                                                                              for c in calls), calls
    else:
        assert len(calls) == 1 and calls[0].endswith("-e .[all,test]"), calls
