"""DeepSeek-V4 in torch, over a ragged batch with kvmesh's heterogeneous cache.

    args.py        ModelArgs (the HF config, validated; ConfigError), layer-type names
    transformer.py the network: embedding, blocks with mHC residual streams, MTP layers, head
    attention.py   compressor, lightning indexer, attention (the only code touching cache views)
    moe.py         routed experts (grouped matmul runs), gate, shared expert
    expert_map.py  EPLB in one MoE layer: a pick's replica (logical -> physical expert), the load counted
    layers.py      norms, RoPE, linear, row gathers
    quant.py       FP8 block-scaled linears and FP4 grouped experts, kept quantized
    shard.py       one rank's part of the model (Shard) and the TP=1 collectives (SingleRank)
    step.py        StepInput: the step's index tensors, built once so no layer loops over sequences

Split by what each part depends on: attention alone reads and writes the cache; the MoE
alone touches quantized experts; the transformer wires them. Parameter names follow the
upstream checkpoint, so loading (workers.checkpoint) is a rename-free copy. Parallelism and
serving stay out: the model sees a `Shard` and a collectives object, nothing else.
"""
