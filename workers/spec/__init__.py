"""Speculative decoding: the exact draft-verify loop (speculative.py: Speculator, Drafter,
DraftLimits; a rejected draft's cache writes are rolled back, so greedy output equals plain
decoding) and the MTP drafter that runs the checkpoint's own multi-token-prediction layer
(mtp.py)."""
