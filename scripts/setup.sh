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
# --no-compile, then one compileall on every core: pip byte-compiles the ~19,000 files of torch,
# Ray and transformers one after another (~60 s of one core). The .pyc files must be written here,
# kvmesh's own packages' too: with PYTHONDONTWRITEBYTECODE=1 (this machine sets it) no process
# writes one later, and each would compile what it imports from source every time it starts.
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install -q --no-compile "torch>=2.4"
    else
        python -m pip install -q --no-compile "torch==${KVMESH_TORCH_VERSION:-2.13.0}"
    fi
fi
PURELIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# torch's ~2,300 files compile on the other core while pip installs the rest on one (pip is serial)
python -m compileall -qq "$PURELIB/torch" >/dev/null 2>&1 & COMPILE_TORCH=$!
python -m pip install -q --no-compile -e ".[${KVMESH_EXTRAS:-test}]"
wait "$COMPILE_TORCH" || true
# -qq: a package's test data that is not Python 3 (pip skips those too) is no error here. -x: parts
# kvmesh never imports (Ray's libraries for RL, tuning, training and datasets; transformers' ~550
# other models), ~4,000 files; a module of them that is imported after all is compiled in memory.
# torch's files are up to date by now and only checked.
python -m compileall -qq -j 0 -x '/ray/(rllib|tune|train|data|air)/|/transformers/models/(?!auto/|deepseek_v4/)' \
    "$PURELIB" kvmesh cluster workers kvstore kernels || true
