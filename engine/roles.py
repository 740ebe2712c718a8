"""The three worker roles, named once. Torch-free: the router imports it.

- `PREFILL`: runs prompts, sends the first token, holds the KV for a decode peer.
- `DECODE`: takes KV from a prefill peer (or prefills short prompts itself) and decodes.
- `COLOCATED`: a whole request from prompt to last token (the baseline, one engine replica).
"""

from __future__ import annotations

from typing import Final

PREFILL: Final = "prefill"
DECODE: Final = "decode"
COLOCATED: Final = "colocated"
ROLES: Final = (COLOCATED, PREFILL, DECODE)
# Roles that decode (and so can take a request whole: local prefill).
DECODING_ROLES: Final = (DECODE, COLOCATED)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role
