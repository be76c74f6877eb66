"""kvmesh: disaggregated prefill/decode serving for DeepSeek-V4-class models, with cross-node prefix reuse.

Everything kvmesh installs lives under this one import name; its four parts keep their folders at the
repository root (DESIGN.md §6) and are mapped here by setuptools' `package-dir` (pyproject.toml):

    kvmesh.cluster   <- cluster/    the Ray Serve application, the OpenAI API, the `kvmesh` CLI
    kvmesh.workers   <- workers/    one engine process: model, engine loop, sampling, parallel ranks
    kvmesh.kernels   <- kernels/    attention, compressor, indexer, quant ops (torch reference, Triton)
    kvmesh.kvstore   <- kvstore/    the cache below the engine: device memory, store, index, transfers

An installed wheel holds them as `kvmesh/cluster/...`. From a checkout (an editable install, or
`python -m` in the repository root) the same names resolve to the root folders: this package's path
then also holds the repository root, so `kvmesh.cluster` is `<root>/cluster`. No other top-level name
is ever claimed (`kernels` is Hugging Face's package).
"""
import os as _os

__version__ = "0.1.0"

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_ROOT, *f)) for f in (("pyproject.toml",), ("kvstore", "__init__.py"))):
    __path__.append(_ROOT)      # a checkout: kvmesh.cluster -> <root>/cluster (an installed wheel never has this)
