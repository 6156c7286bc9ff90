"""Pool data: read, tokenize, pack, cache and serve superbatches.

``readers`` (jsonl/parquet/text documents), ``tokenizer`` (bytes), ``packing`` (documents into one
token stream with stable sample ids), ``token_bin`` (pre-tokenized ``.bin`` pools), ``subset``
(subset files), ``loader`` (resumable, DDP-sharded superbatches), ``cache`` (where splits are
cached), ``default_corpus`` (the offline default corpus), and ``datamodule`` (``PoolDataModule``,
the one Lightning face of this package).
"""

__all__ = ["cache", "datamodule", "default_corpus", "loader", "packing", "readers", "subset", "token_bin", "tokenizer"]
