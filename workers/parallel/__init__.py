"""One engine across several ranks: process groups and the collectives the model uses
(collectives.py: Collectives, RankFailed) and the rank-0-leads protocol (replica.py: Leader,
RankLauncher, LocalProcessLauncher, run_rank), and expert-parallel load balancing (eplb.py:
DeepSeek's placement algorithm, pure torch; expert_balance.py: ExpertBalancer, one DP rank's
load window, rebalances and in-place expert moves). Rank 0's cache is a kvstore.device.mirror.MirroredCache
so the other ranks replay its writes. It imports model/ and checkpoint/ (a rank loads its shard)
and never the engine: the engine starts its ranks through a RankLauncher."""
