"""The OpenAI request models (cluster/openai/protocol.py): OpenAI's shapes are accepted, a bad
field is a 400 that names it."""
from __future__ import annotations

import pytest

from cluster.errors import APIError
from cluster.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body


def test_request_models_accept_openai_shapes_and_name_bad_fields():
    body = parse_body(b'{"prompt": [1, 2], "temperature": 0, "stop": "x", "stream": true, "stream_options": {"include_usage": true}}',
                      CompletionRequest)
    assert body.prompt == [1, 2] and body.stop_strings == ["x"] and body.include_usage
    chat = parse_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                      b'{"type": "text", "text": "b"}]}], "max_completion_tokens": 5}', ChatCompletionRequest)
    assert chat.messages[0].text == "ab" and chat.token_limit == 5
    with pytest.raises(APIError) as e:
        parse_body(b'{"prompt": "x", "temprature": 1}', CompletionRequest)
    assert e.value.status == 400 and e.value.param == "temprature"
