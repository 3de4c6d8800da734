"""This gateway's tokenizer fingerprint, compared with each worker's before routing to it.

The probe and the hash are ``contract.tokenizer_probe``'s; the ids are the
gateway's own rendering and encoding, exactly as it tokenizes a chat request.
"""

from __future__ import annotations

from contract.tokenizer_probe import PROBE_MESSAGES, PROBE_TEXT, fingerprint
from gateway.text.tokenizer import ChatTokenizer


def tokenizer_fingerprint(tokenizer: ChatTokenizer) -> str:
    """``fingerprint`` of the probe chat (template rendered) and probe text, no special tokens."""
    try:
        chat = tokenizer.encode_text(tokenizer.render(PROBE_MESSAGES))
    except ValueError:  # no chat template: as contract.tokenizer_probe.probe_ids
        chat = []
    return fingerprint(chat, tokenizer.encode_text(PROBE_TEXT))
