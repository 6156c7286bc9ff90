"""Bench-Docs: the pool documents nearest a benchmark (or target) set, a document set to align to.

    selection-callbacks bench-docs --pool data/default/pool.jsonl \
        --target data/default/target.jsonl --budget-tokens 200000 --out data/bench_docs.jsonl

(``python -m selection_callbacks.offline.bench_docs`` takes the same arguments.)

Each pool document is scored by its maximum cosine similarity to any target document; documents
are kept in descending score until the token budget (byte tokens) is reached. The output is a
jsonl (``id``, ``text``, ``domain``, ``score``) usable as ``OPUSSelection(target_file=...)`` or as
``--data.target``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.data.readers import Document, iter_documents
from selection_callbacks.offline.common.embeddings import Embedder, make_embedder

__all__ = ["build_parser", "main", "max_cosine", "run", "write_bench_docs"]


def max_cosine(pool: np.ndarray, target: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """max_j ⟨p_i, t_j⟩ for unit rows, in chunks of pool rows."""
    return np.concatenate([(pool[i : i + chunk] @ target.T).max(1) for i in range(0, pool.shape[0], chunk)])


def write_bench_docs(pool: str, target: str, budget_tokens: int, out: str | Path, embedder: Embedder) -> dict:
    """Write the top pool documents by max cosine to the target, up to ``budget_tokens``; returns a summary."""
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be ≥ 1, got {budget_tokens}")
    start = time.perf_counter()
    docs: list[Document] = list(iter_documents(pool))
    targets = [d.text for d in iter_documents(target)]
    if not docs or not targets:
        raise ValueError(f"empty {'pool' if not docs else 'target'}: nothing to score")
    scores = max_cosine(embedder.embed([d.text for d in docs]), embedder.embed(targets))
    kept, tokens = [], 0
    for i in np.argsort(-scores, kind="stable"):
        if tokens >= budget_tokens:
            break
        kept.append(int(i))
        tokens += len(docs[i].text.encode("utf-8")) + 1
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i in kept:
            d = docs[i]
            f.write(json.dumps({"id": d.id, "text": d.text, "domain": d.domain, "score": round(float(scores[i]), 6)}) + "\n")
    composition = Counter(docs[i].domain for i in kept)
    return {
        "embedder": embedder.name,
        "documents": len(kept),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - start, 2),
        "domains": {k: v / len(kept) for k, v in sorted(composition.items())},
        "min_score": float(scores[kept[-1]]) if kept else None,
    }


def build_parser(parent: ActionSubCommands | None = None, name: str = "bench-docs") -> ArgumentParser:
    """The ``bench-docs`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.split("\n\n")[0]
    p = ArgumentParser(prog="python -m selection_callbacks.offline.bench_docs", description=description)
    p.add_argument("--pool", required=True, help="candidate documents (jsonl, parquet or a folder of text)")
    p.add_argument("--target", required=True, help="benchmark/target documents (never the val split)")
    p.add_argument("--budget-tokens", type=int, required=True,
                   help="keep the closest documents until they hold ≥ this many byte tokens")
    p.add_argument("--out", required=True, help="Bench-Docs jsonl to write (id, text, domain, score)")
    p.add_argument("--embedder", choices=["auto", "minilm", "hashed"], default="auto",
                   help="document embeddings: minilm, hashed n-grams, or auto (MiniLM when installed, else hashed)")
    if parent is not None:
        parent.add_subcommand(name, p, help=description)
    return p


def run(a: Namespace) -> dict:
    """Write the Bench-Docs set a ``build_parser()`` namespace describes; prints and returns the summary."""
    summary = write_bench_docs(a.pool, a.target, a.budget_tokens, a.out, make_embedder(a.embedder))
    print(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> dict:
    """``python -m selection_callbacks.offline.bench_docs``: parse ``argv``, write the set, return the summary."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
