"""Who calls: a request's API key checked against the server's keys (in constant time), and the
tenant it belongs to, whose suffix memory it drafts from (runtime/memories.py)."""

from __future__ import annotations

import hmac

from specgen.runtime import memories


def given(headers) -> str:
    """The key a request sends (`Authorization: Bearer KEY`), "" when none."""
    header = headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def authorized(keys: list[str], headers) -> bool:
    """Whether the request holds one of `keys`; every key is compared, in constant time."""
    sent, ok = given(headers).encode(), False
    for key in keys:
        ok |= hmac.compare_digest(sent, key.encode())
    return ok


def tenant(keys: list[str], headers) -> str:
    """The tenant of an authorized request: the server's own for its local token (`keys[0]`),
    else a digest of its key."""
    sent = given(headers)
    return memories.OWN if hmac.compare_digest(sent.encode(), keys[0].encode()) else memories.tenant_of(sent)
