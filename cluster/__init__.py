"""The cluster: the OpenAI HTTP front, the Serve pools of engines, the chat format, the CLI.

    app.py         build_app(config): the Serve application (`serve run` / `kvmesh serve` import it)
    config.py      ServeConfig: the serve YAML, validated once (pools, ingress, engine settings)
    messages.py    one dataclass per message between the ingress and the pools (GenRequest, Chunk, Handoff)
    errors.py      the errors the parts raise across packages (APIError and its constructors, WorkerFailed)
    openai/        the HTTP edge: request models, the ingress and its endpoints, auth, responses, limits
    chat/          text <-> tokens: chat templates, DeepSeek-V4's encoder and reply parser, the tool-call
                   grammar, incremental detokenization
    serve/         the Serve side: pools (prefill / decode / colocated), rank actors, replica routing,
                   the prefix locator, dispatch across pools, handoff transport, metrics
    cli/           `kvmesh`: one module per command

Layering: cli -> app -> {openai, serve} ; openai -> {chat, serve} ; all -> {config, messages, errors}.
Nothing in chat/ or serve/ imports openai/, and nothing but cli/ imports app
(tests/unit/test_layering.py fails on any ring between these, function-level imports included).
No environment variable is read below this package.
"""
