#!/usr/bin/env bash
# Create .venv and install kvmesh with its test extras. On a machine without CUDA the
# CPU build of torch is installed first, so the project's torch range is already met
# and pip never downloads a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
# system packages some integration tests need (root + apt only; without them those tests skip):
# sshd for the on-prem `ray up` test (tests/integration/test_onprem_cluster.py runs one per
# network namespace with its own config; the package's own service is not needed), iptables for
# the chaos tests (tests/integration/test_chaos.py: partitions and lossy links, in the hosts' own
# network namespaces)
apt_install() {     # package, the tests that skip without it
    command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] || return 0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$1" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends "$1" >/dev/null; } \
        || echo "setup.sh: could not install $1; $2 will skip" >&2
}
[ -x /usr/sbin/sshd ] || apt_install openssh-server "the on-prem cluster test"
[ -x /usr/sbin/iptables ] || command -v iptables >/dev/null 2>&1 || apt_install iptables "the chaos tests"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# --no-compile: pip would byte-compile the ~19,000 files of torch, Ray and transformers one after
# another (~60 s of one core), most of which no kvmesh process ever imports. Each process that
# imports a module writes its .pyc the first time instead (~3,500 files, ~12 s of a core in all);
# the Makefile unexports PYTHONDONTWRITEBYTECODE (this machine sets it) for that, as without .pyc
# files every process would compile what it imports from source every time it starts.
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install -q --no-compile "torch>=2.4"
    else
        python -m pip install -q --no-compile "torch==${KVMESH_TORCH_VERSION:-2.13.0}"
    fi
fi
PURELIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# torch, which nearly every process imports, compiles on the other core while pip installs the rest
# on one (pip is serial), so the first processes do not all compile it at once
python -m compileall -qq "$PURELIB/torch" >/dev/null 2>&1 & COMPILE_TORCH=$!
python -m pip install -q --no-compile -e ".[${KVMESH_EXTRAS:-test}]"
wait "$COMPILE_TORCH" || true
