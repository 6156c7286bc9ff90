"""The offline selectors' sharded path: per-document stages as Ray Data map tasks over parquet shards.

Layers, bottom up: ``shards`` (the pool split into parquet shards of id, domain, text), ``stages``
(what one shard's documents compute: pure per-document functions), ``runner`` (a stage over every
shard on Ray Data, each shard's table written atomically with a manifest, so a killed run resumes),
``tables`` (the written tables read back without the pool's text), ``bank`` (the feature bank from
those tables and the global steps), ``select`` (DSIR, AutoData and DATAMASK on the tables, the same
subset file and summary as the single-process ``offline.select``).
"""

__all__ = ["bank", "runner", "select", "shards", "stages", "tables"]
