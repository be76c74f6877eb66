"""Speculative decoding: the exact draft-verify loop (speculative.py: Speculator, Drafter,
DraftLimits; draft_rule.py: DraftRule, the draft length by batch size, torch-free for the config; a rejected draft's cache writes are rolled back, so greedy output equals plain
decoding) and the MTP drafter that runs the checkpoint's own multi-token-prediction layer
(mtp.py)."""
