# shellcheck shell=bash
# The virtual environment that launch/setup.sh sets up and the launch scripts run: HVDCOMP_VENV (relative to the
# checkout or absolute), else .venv, or .venv-staged with HVDCOMP_HOROVOD_GPU_OPS=none (a Horovod that stages CUDA
# tensors through host memory). Sourced with REPO_ROOT set; sets VENV, an absolute path.
if [[ ${HVDCOMP_HOROVOD_GPU_OPS:-auto} == none ]]; then
    VENV=${HVDCOMP_VENV:-.venv-staged}
else
    VENV=${HVDCOMP_VENV:-.venv}
fi
[[ $VENV == /* ]] || VENV="$REPO_ROOT/$VENV"
