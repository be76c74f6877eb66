"""What is on disk: loading a checkpoint (BF16, or FP8/FP4 as released) into the model, how
each weight splits across ranks, the tokenizer, the built-in default checkpoint, the weights'
identity (part of the prefix fingerprint), inspection and sizing.

    loader.py        safetensors -> Transformer (quantized weights stay quantized)
    sharding.py      how each tensor splits under tensor / expert parallelism; size checks
    tokenizer.py     the checkpoint's tokenizer (HF tokenizers) or the byte fallback
    default_model.py the built-in checkpoint (default_checkpoint/, trained by scripts/)
    weights_id.py    a cheap, stable identity of the weight files
    inspect.py       header-only reading: dtypes, resident bytes
    sizing.py        `kvmesh plan`: weights + KV per rank and per node; released.py: V4 shapes

It depends on workers.model (the modules it fills) and never on the engine.
"""
