"""Keep secrets out of logs: URLs are shown without their password."""
from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<secret>[^@/\s]*)@")


def redact_url(text: str) -> str:
    """`redis://:pw@host:6380/0` -> `redis://:***@host:6380/0` (every URL in `text`)."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
