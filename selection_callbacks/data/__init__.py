"""Pool data: read, tokenize, pack, cache and serve superbatches."""
