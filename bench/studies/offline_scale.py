"""The sharded offline path at scale: DSIR and the bank's cheap features over a resampled pool on Ray Data.

    python -m bench.studies.offline_scale --docs 2000000 --workers 2 --shards 64 --out bench/results/offline-scale

One command: the pool is *resampled* from the default corpus (built under ``<out>/source`` when
``--source`` is not given) by :func:`resample_pool`, random whole-word spans of random documents
(each span a uniform share in [``--min-share``, 1] of its source), written chunk by chunk to
``<out>/pool.jsonl`` until it holds ``--docs`` documents (ids ``<source id>~<k>@<chunk>``). Then
``select dsir --engine ray`` runs the stages ``count`` (the bank's cheap columns and DSIR's n-gram
counts) and ``score`` (log_freq and DSIR's log w) as map tasks and keeps ``--budget-share`` of the
pool's tokens. ``<out>/report.json`` holds the pool's size, the seconds of every stage, the
seconds and peak memory per worker, and the projected seconds per billion documents on the same
workers (seconds × 10⁹ / D, map stages and driver steps alike). A rerun reuses the pool and the
shards already written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jsonargparse import ArgumentParser

from selection_callbacks.data.corpus_docs import SPLIT_FILES
from selection_callbacks.data.default_corpus import build_default_corpus
from selection_callbacks.data.readers import iter_documents
from selection_callbacks.data.resampled_pool import resample_pool
from selection_callbacks.offline.common.corpus import Budget
from selection_callbacks.offline.dsir.selector import DSIRConfig
from selection_callbacks.offline.sharded.select import EngineConfig, run_sharded_selection

CHUNK_MB = 32.0


def write_resampled_pool(source: Path, out: Path, docs: int, min_share: float, seed: int) -> dict:
    """``docs`` resampled documents of ``source``'s pool as jsonl at ``out``; its size (reused when complete)."""
    record = out.with_suffix(".json")
    if record.exists() and json.loads(record.read_text())["documents"] == docs:
        return json.loads(record.read_text())
    sources = list(iter_documents(source / SPLIT_FILES["pool"]))
    written, n_bytes, chunk = 0, 0, 0
    start = time.perf_counter()
    with out.open("w", encoding="utf-8") as f:
        while written < docs:
            for d in resample_pool(sources, CHUNK_MB, seed + chunk, min_share)[: docs - written]:
                f.write(json.dumps({"id": f"{d.id}@{chunk}", "text": d.text, "domain": d.domain}) + "\n")
                n_bytes += len(d.text.encode("utf-8"))
                written += 1
            chunk += 1
    info = {"documents": written, "text_bytes": n_bytes, "file_bytes": out.stat().st_size,
            "resampled_from": str(source / SPLIT_FILES["pool"]), "min_share": min_share, "seed": seed,
            "seconds": round(time.perf_counter() - start, 1)}
    record.write_text(json.dumps(info, indent=1))
    return info


def projected(report: dict, docs: int) -> dict:
    """Seconds per stage and in all, scaled linearly to 10⁹ documents on the same workers."""
    stages = {f"map: {k}": v["seconds"] for k, v in report["map_stages"].items()}
    stages.update({f"driver: {k}": v["seconds"] for k, v in report["driver"].items()})
    per_billion = {k: round(s * 1e9 / docs, 1) for k, s in stages.items()}
    total = sum(stages.values()) * 1e9 / docs
    return {"stage_seconds": stages, "seconds_per_billion_docs": per_billion,
            "total_seconds_per_billion_docs": round(total, 1), "total_hours_per_billion_docs": round(total / 3600, 2)}


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=2_000_000, help="documents in the resampled pool")
    p.add_argument("--min-share", type=float, default=0.05, help="shortest span, as a share of its source")
    p.add_argument("--source", default=None, help="a corpus folder (pool.jsonl, target.jsonl); default: build it")
    p.add_argument("--workers", type=int, default=2, help="map tasks at a time")
    p.add_argument("--shards", type=int, default=64, help="parquet shards of the pool")
    p.add_argument("--address", default=None, help="a running Ray cluster (default: a local one)")
    p.add_argument("--budget-share", type=float, default=0.1, help="share of the pool's tokens DSIR keeps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/offline-scale")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(a.source) if a.source else out / "source"
    if not a.source and not (source / SPLIT_FILES["pool"]).exists():
        build_default_corpus(source, seed=0)
    pool = write_resampled_pool(source, out / "pool.jsonl", a.docs, a.min_share, a.seed)
    tokens = pool["text_bytes"] + pool["documents"]
    engine = EngineConfig("ray", a.workers, a.shards, str(out / "work"), a.address)
    summary = run_sharded_selection("dsir", out / "pool.jsonl", source / SPLIT_FILES["target"],
                                    Budget(tokens=max(1, int(a.budget_share * tokens))), a.seed,
                                    out / "subset.parquet", DSIRConfig(), engine)
    stages = json.loads(Path(f"{out / 'subset.parquet'}.stages.json").read_text())
    report = {"pool": pool, "engine": stages["engine"], "selected": {"documents": summary["documents"],
              "tokens": summary["tokens"]}, "seconds": summary["seconds"], "map_stages": stages["map_stages"],
              "driver": stages["driver"], "projection": projected(stages, pool["documents"])}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["projection"], indent=1))
    return report


if __name__ == "__main__":
    main()
