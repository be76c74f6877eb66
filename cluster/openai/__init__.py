"""The OpenAI-compatible HTTP edge.

    protocol.py            request models (validated once, every unknown field a 400) and parse_body
    ingress.py             the Serve deployment and its FastAPI app: exception handlers, routes (each a
                           thin call into a serving object), health, models, version, metrics, docs
    serving.py             the base every generating endpoint shares: body -> prompts -> dispatch ->
                           Reply -> JSON body or SSE (OpenAIServing, Generation), errors -> OpenAI bodies
    serving_completion.py  /v1/completions: text or id prompts, echo, `text_completion` bodies
    serving_chat.py        /v1/chat/completions: messages in the chat format, `chat.completion` bodies
    serving_tokenize.py    /tokenize and /detokenize
    validate.py            a request's prompts against the workers' limits: every 400, before any worker
    responses.py           response bodies and SSE chunks, built from the chunks a generation streams
    auth.py                API keys (`Authorization: Bearer`) as one FastAPI dependency, every route but /health
    limits.py              the request body limit, checked before the body is all read; the workers' limits
    proxy_guard.py         what Serve's HTTP proxy answers itself: /-/routes not served (the proxy callback)

Within the package: ingress -> serving_* -> serving -> validate -> {limits, protocol, responses};
auth, limits, protocol, responses and proxy_guard import none of the others.
"""
