"""The tokenizer agreement probe and fingerprint every worker record carries.

A gateway sends token ids, so a worker must read them with the very same
vocabulary and chat template, or its KV (and its answers) belong to other
text. Both sides encode the same fixed probe — a chat with a system prompt,
rendered with the template, and a plain text — and hash the ids. A worker
whose fingerprint differs from the gateway's is never routed to; an empty
fingerprint (a record from before this field) is not checked.

``probe_ids`` takes any Hugging Face-style tokenizer (``apply_chat_template``
and ``encode``); contract never imports transformers itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

FINGERPRINT_VERSION = "tok1"

# Whitespace, accents, CJK and markup next to the template's markers, where two
# tokenizers or templates that differ at all are most likely to disagree.
PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are the kvroute tokenizer probe.  Answer tersely."},
    {"role": "user", "content": "Héllo, 世界!\n\tCount: 1 2 3 <b>x</b> ok?"},
)
PROBE_TEXT = " kvroute probe: Ünïcode 世界 \n\n\t<|tab|> 12345 end."


def fingerprint(chat_ids: Sequence[int], text_ids: Sequence[int]) -> str:
    """A short, stable name for a tokenizer: a hash of its ids for the two probes."""
    raw = ",".join(map(str, chat_ids)) + "|" + ",".join(map(str, text_ids))
    return f"{FINGERPRINT_VERSION}:{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def probe_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(chat ids, text ids) of the probe: template rendered to text, no extra special tokens.

    A tokenizer without a chat template (a base model) has no chat ids: ``[]``.
    """
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in PROBE_MESSAGES], add_generation_prompt=True, tokenize=False
        )
    except ValueError:  # transformers: no chat template
        text = None
    chat = [] if not isinstance(text, str) else chat_ids(tokenizer, text)
    plain = [int(t) for t in tokenizer.encode(PROBE_TEXT, add_special_tokens=False)]
    return chat, plain


def chat_ids(tokenizer: Any, rendered: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(rendered, add_special_tokens=False)]
