"""The engine's failures that the serving layer catches and retries, torch-free so the API
process (the ingress) can name them without loading the engine."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the message carries the cause."""


class RankFailed(RuntimeError):
    """A rank of this replica died, or a collective timed out: the engine cannot go on."""
