"""One engine process, in parts a reader can find by name:

    request.py        Sequence, Status, RequestOutput, Resume: the leaf every part imports
    engine_config.py  EngineConfig: every engine setting, its default and its validation, once
    errors.py         EngineDeadError, RankFailed: what the serving layer retries, torch-free
    processes.py      how local child processes start (ranks, schema compilers): a preloaded fork server
    model/            DeepSeek-V4 in torch (args, transformer, attention, moe, quant, shard, step)
    checkpoint/       loading, quantized formats, sharding, tokenizer, built-in model, sizing
    engine/           loop, builder, output processing, scheduler, KV-cache manager, runner, stats
    sampling/         params, batch sampler, penalties, grammar (+ its compile pool)
    spec/             speculative decoding (exact), the MTP drafter
    reuse/            prefix cache across tiers, the adaptive SWA policy
    parallel/         collectives, the tensor-parallel replica protocol
    replay.py         trace replay through one engine (bench/ and tests)

Dependencies point one way: engine -> {model, checkpoint, sampling, spec, reuse, parallel}
-> request, engine_config -> kvstore, kernels. Nothing below engine/ imports it.
"""
