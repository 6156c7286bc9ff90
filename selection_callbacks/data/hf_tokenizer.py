"""A Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``) with exact per-token byte counts.

Bits per byte divides summed nats by the UTF-8 bytes of the text the predicted tokens cover. A
subword token's byte count depends on where it sits once a normaliser (NFKC, lowercase, ...) has
rewritten the text (``ﬁ``, 3 bytes, becomes ``fi``), so it is read per position, from the
tokenizer's offsets into the original text, not from the vocabulary:

    nbytes_i = B(max(e_0, …, e_i)) − B(max(e_0, …, e_{i−1})),    B(c) = UTF-8 bytes of text[:c],

with ``e_i`` the end character offset of token ``i`` (``e_{−1} = 0``), and the bytes after the last
token's end added to the last token. A document's tokens therefore sum to ``len(text.encode())``
exactly (a text that gives no token at all, e.g. only whitespace a pre-tokenizer drops, has no bytes
any prediction covers): text a pre-tokenizer drops belongs to the next token, and the tokens that share one
character (byte-level BPE splitting a multi-byte character) give it to the first of them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

__all__ = ["BOUNDARY_CANDIDATES", "HFTokenizer", "char_byte_offsets", "offsets_to_nbytes"]

BOUNDARY_CANDIDATES = ("<|endoftext|>", "</s>", "<s>", "<|begin_of_text|>", "<bos>", "<eos>", "[SEP]", "[CLS]")
"""Special tokens tried, in order, as the document-boundary token when none is named."""


def char_byte_offsets(text: str) -> np.ndarray:
    """int64 [len(text)+1]: UTF-8 bytes of ``text[:c]`` for every character offset c (a lone surrogate counts 1, as ``errors="replace"`` writes it)."""
    cp = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    size = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
    size[(cp >= 0xD800) & (cp <= 0xDFFF)] = 1
    out = np.zeros(cp.size + 1, dtype=np.int64)
    np.cumsum(size, out=out[1:])
    return out


def offsets_to_nbytes(ends: np.ndarray, char_bytes: np.ndarray) -> np.ndarray:
    """int64 [n]: original UTF-8 bytes per token from end character offsets ``ends`` [n] (module docstring)."""
    if ends.size == 0:
        return np.zeros(0, dtype=np.int64)
    reach = np.maximum.accumulate(np.asarray(ends, dtype=np.int64))
    covered = char_bytes[reach]
    out = np.diff(covered, prepend=0)
    out[-1] += char_bytes[-1] - covered[-1]
    return out


class HFTokenizer:
    """A ``tokenizer.json`` that marks each document start with a boundary token and counts bytes per token.

    Example::

        tok = HFTokenizer("runs/bpe/tokenizer.json")
        ids, nbytes = tok.encode_document_with_bytes("ﬁne text")   # nbytes.sum() == len("ﬁne text".encode())

    Args:
        path: a ``tokenizer.json`` (``tokenizers.Tokenizer.save``; a transformers fast tokenizer's file).
        boundary_token: the special token written before every document; default: the first of
            :data:`BOUNDARY_CANDIDATES` in the vocabulary.
    """

    per_token_bytes = True

    def __init__(self, path: str | Path, boundary_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {str(self.path)!r} does not exist; pass a tokenizer.json or train one with "
                "`selection-callbacks tokenizer --pool POOL --target TARGET`"
            )
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"cannot load tokenizer {str(self.path)!r}: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._boundary_id(boundary_token)
        self.boundary_token: str = self._tok.id_to_token(self.bos_id)
        self.special_ids = sorted({t_id for t_id, t in self._tok.get_added_tokens_decoder().items() if t.special}
                                  | {self.bos_id})
        self.dtype = np.uint16 if self.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
        self._fingerprint = "hf-" + hashlib.sha256(self.path.read_bytes() + f"|{self.bos_id}".encode()).hexdigest()[:16]

    def _boundary_id(self, name: str | None) -> int:
        names = (name,) if name is not None else BOUNDARY_CANDIDATES
        for n in names:
            token_id = self._tok.token_to_id(n)
            if token_id is not None:
                return int(token_id)
        if name is not None:
            raise ValueError(f"boundary token {name!r} is not in {str(self.path)!r}; name one of its special tokens")
        raise ValueError(
            f"{str(self.path)!r} has none of {list(BOUNDARY_CANDIDATES)}; name its document-boundary special token "
            "with data.boundary_token"
        )

    def encode_document_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``[BOS] + tokens(text)`` ids and their original UTF-8 bytes (0 for BOS), both [1 + n]."""
        enc = self._tok.encode(text, add_special_tokens=False)
        ids = np.empty(len(enc.ids) + 1, dtype=self.dtype)
        ids[0] = self.bos_id
        ids[1:] = enc.ids
        nbytes = np.zeros(ids.size, dtype=np.int64)
        ends = np.asarray([e for _, e in enc.offsets], dtype=np.int64)
        nbytes[1:] = offsets_to_nbytes(ends, char_byte_offsets(text))
        return ids, nbytes

    def encode_document(self, text: str) -> np.ndarray:
        """``[BOS] + tokens(text)`` ids."""
        return self.encode_document_with_bytes(text)[0]

    def token_bytes(self, vocab_size: int | None = None) -> None:
        """No per-id byte table: bytes are per position (``label_bytes`` in every batch)."""
        return None

    def fingerprint(self) -> str:
        """Identifies the token mapping in cache keys: the file's sha256 and the boundary id."""
        return self._fingerprint

    def text_ids(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size]: ids that stand for text (not special tokens, not padding rows)."""
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[: min(self.vocab_size, vocab_size)] = True
        out[[i for i in self.special_ids if i < vocab_size]] = False
        return out
