"""Pool data: read, tokenize, pack, cache and serve superbatches.

``documents`` (what readers yield), ``readers`` (jsonl/parquet/arrow/text and saved-dataset
documents, one entry point), ``hf_datasets`` (Hugging Face ``datasets`` sources and streaming),
``tokenizer`` (bytes), ``hf_tokenizer`` (a ``tokenizer.json`` with per-token bytes), ``bpe_training``
(the offline byte-level BPE command), ``packing`` (documents into one token stream with stable
sample ids), ``token_bin`` (pre-tokenized ``.bin`` pools), ``subset`` (subset files), ``loader``
(resumable, DDP-sharded superbatches), ``stream_loader`` (the same from a stream, through a seeded
shuffle buffer), ``cache`` (where splits are cached), ``default_corpus`` (the offline default corpus),
and ``datamodule`` (``PoolDataModule``, the one Lightning face of this package).
"""

__all__ = ["bpe_training", "cache", "datamodule", "default_corpus", "documents", "hf_datasets", "hf_tokenizer",
           "loader", "packing", "readers", "stream_loader", "subset", "token_bin", "tokenizer"]
