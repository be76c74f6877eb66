"""The built-in default model: a small DeepSeek-V4-shaped LM, trained, shipped inside the package.

`workers/checkpoint/default_checkpoint/` holds what `scripts/train_default_model.py` wrote: config.json
+ model.safetensors (transformers' `save_pretrained` format, upstream tensor names), a
byte-level BPE tokenizer.json with V4's chat tokens whose vocabulary is the model's (so chat is
served in V4's format), tokenizer_config.json, mtp.safetensors (its MTP layer). Every
part of the real network is there (SWA, CSA and HCA layers, mHC, hash and top-k MoE with a
shared expert, indexer, YaRN compress rope) at toy width, trained on the World English Bible
(public domain) so its greedy continuations read as English. Nothing is downloaded or
generated at start-up; the whole load path is the one real checkpoints take.
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_checkpoint"
DEFAULT_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    return DEFAULT_MODEL_DIR


def ensure_default_model(path: Path | None = None) -> Path:
    """The shipped checkpoint's directory (or `path`), checked to hold every file it needs."""
    path = path or DEFAULT_MODEL_DIR
    missing = [name for name in DEFAULT_MODEL_FILES if not (path / name).is_file()]
    if missing:
        from .loader import CheckpointError     # torch: not at import (the ingress never loads weights)
        raise CheckpointError(f"default model at {path} lacks {', '.join(missing)}: the package is "
                              "incomplete (reinstall kvmesh) or re-run scripts/train_default_model.py")
    return path
