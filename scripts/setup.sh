#!/usr/bin/env bash
# Create .venv and install kvmesh with its test extras. On a machine without CUDA the
# CPU build of torch is installed first, so the project's torch range is already met
# and pip never downloads a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
# sshd for the on-prem `ray up` test (tests/integration/test_onprem_cluster.py runs one per
# network namespace with its own config; the package's own service is not needed)
if [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends openssh-server >/dev/null; } \
        || echo "setup.sh: could not install openssh-server; the on-prem cluster test will skip" >&2
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install -q "torch>=2.4"
    else
        python -m pip install -q "torch==${KVMESH_TORCH_VERSION:-2.13.0}"
    fi
fi
python -m pip install -q -e ".[${KVMESH_EXTRAS:-test}]"
