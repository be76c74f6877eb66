"""The OpenAI-compatible HTTP edge.

    protocol.py    request models (validated once, every unknown field a 400) and parse_body
    ingress.py     the Serve ingress: FastAPI routes, tokenization, routing hints, dispatch
    responses.py   response bodies and SSE chunks, built from the chunks a generation streams
    auth.py        API keys (`Authorization: Bearer`), every route but /health
    limits.py      the request body limit, checked before the body is all read
"""
