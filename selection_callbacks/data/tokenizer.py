"""Byte-level tokenizer: one token per UTF-8 byte, plus a document-boundary token."""

from __future__ import annotations

import numpy as np
import torch


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0..255) and marks each document start with ``bos_id``.

    Bits-per-byte needs the byte length of each token: ``token_bytes()[id]`` is 1 for a byte
    token and 0 for the boundary token, so boundary predictions are excluded from bpb.
    """

    bos_id: int = 256
    vocab_size: int = 257

    def encode_document(self, text: str) -> np.ndarray:
        """``[BOS] + utf8(text)`` as uint16 ids."""
        body = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        out = np.empty(body.size + 1, dtype=np.uint16)
        out[0] = self.bos_id
        out[1:] = body
        return out

    def token_bytes(self, vocab_size: int | None = None) -> torch.Tensor:
        """Float tensor [vocab_size]: UTF-8 bytes each id stands for (0 for specials and padding)."""
        n = max(vocab_size or self.vocab_size, self.vocab_size)
        out = torch.zeros(n)
        out[:256] = 1.0
        return out

    def fingerprint(self) -> str:
        """Identifies the token mapping in cache keys."""
        return "byte-v1"
