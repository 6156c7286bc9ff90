"""DATAMASK at scale: time, peak memory and the convergence curve on synthetic data.

    python -m bench.studies.datamask_scale --out bench/results/datamask/scale.json

1M synthetic documents with 384-d float32 unit embeddings drawn around Zipf-sized clusters and a
quality score with a cluster part and a document part; DATAMASK selects S = 100k with G = 128
masks per iteration (library defaults otherwise: pruning 40%, 100k-document chunks, 5% partial
updates, pairwise diversity). The objective (mean f of the sampled masks) is recorded per
iteration; the plateau is the first iteration T from which on the smoothed curve rises by less
than 1% of its value over the last 10% of iterations, ⌊0.9T⌋..T (the curve is the mean over
chunks; f ≈ 0 for a random subset, see ``plateau``). ``seconds_total`` covers DATAMASK only (the
synthetic data is generated before the clock starts), ``seconds_per_iter`` is one iteration of one
chunk, ``seconds_at_plateau`` what a run stopped at the plateau would take; peak RSS is the
process high-water mark.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import numpy as np
from jsonargparse import ArgumentParser

from bench.harness.report import write_json
from selection_callbacks.offline.datamask.selector import datamask


def synthetic(
    docs: int, dim: int, clusters: int, seed: int, block: int = 65536
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit embeddings [docs, dim] (float32), quality [docs] and cluster labels [docs].

    Cluster sizes follow Zipf (p_k ∝ 1/k); x = centre + 0.8·noise/√dim per document; quality =
    cluster quality + 0.5·document noise, with cluster quality ~ N(0, 1).
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim), dtype=np.float32) / np.sqrt(dim, dtype=np.float32)
    p = 1.0 / np.arange(1, clusters + 1)
    labels = rng.choice(clusters, size=docs, p=p / p.sum())
    emb = np.empty((docs, dim), dtype=np.float32)
    root_dim = np.sqrt(dim, dtype=np.float32)
    for i in range(0, docs, block):
        lab = labels[i : i + block]
        x = centres[lab] + 0.8 * rng.standard_normal((len(lab), dim), dtype=np.float32) / root_dim
        emb[i : i + block] = x / np.linalg.norm(x, axis=1, keepdims=True)
    quality = rng.standard_normal(clusters)[labels] + 0.5 * rng.standard_normal(docs)
    return emb, quality, labels


def plateau(curve: list[float], share: float = 0.1, tolerance: float = 0.01) -> int | None:
    """First T from which on the smoothed curve rises by less than ``tolerance``·|f(T)| over [⌊(1−share)T⌋, T].

    f is measured from a random subset's objective, which is ≈ 0 here by construction (quality is
    z-scored over the candidates, embeddings are centred), so this reads "the last 10% of iterations
    added < 1% to the objective's gain over random selection". None when the curve is still rising
    at its end. Smoothing: a moving mean over len/20 iterations.
    """
    c = np.asarray(curve)
    w = max(1, len(c) // 20)
    smooth = np.convolve(c, np.ones(w) / w, mode="valid")  # smooth[t] averages curve[t..t+w−1]
    at = None
    for t in range(1, len(smooth)):
        flat = smooth[t] - smooth[int((1 - share) * t)] < tolerance * abs(smooth[t])
        at = (at if at is not None else t) if flat else None
    return None if at is None else at + w - 1


def mean_pairwise_cosine(emb: np.ndarray, idx: np.ndarray, mean: np.ndarray) -> float:
    """Mean pairwise cosine of the centred, re-normalised rows ``idx`` (the objective's diversity, negated)."""
    total, sq = np.zeros(emb.shape[1], dtype=np.float64), 0.0
    for i in range(0, len(idx), 65536):
        x = emb[idx[i : i + 65536]] - mean
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        total += x.sum(0)
        sq += float((x * x).sum())
    return float((total @ total - sq) / (len(idx) * (len(idx) - 1)))


def build_parser() -> ArgumentParser:
    """The ``bench.studies.datamask_scale`` flags."""
    p = ArgumentParser(prog="python -m bench.studies.datamask_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="result JSON to write")
    p.add_argument("--docs", type=int, default=1_000_000, help="synthetic documents n")
    p.add_argument("--dim", type=int, default=384, help="embedding dimension d")
    p.add_argument("--budget", type=int, default=100_000, help="S, documents to select")
    p.add_argument("--groups", type=int, default=128, help="G, masks sampled per iteration")
    p.add_argument("--iterations", type=int, default=2500, help="policy-gradient iterations per chunk")
    p.add_argument("--clusters", type=int, default=2000, help="Zipf-sized clusters the embeddings are drawn around")
    p.add_argument("--lam", type=float, default=0.3, help="λ in f = λ·quality + (1−λ)·diversity")
    p.add_argument("--lr", type=float, default=10.0, help="η, the logit step size")
    p.add_argument("--prune", type=float, default=0.4, help="share of the lowest-quality documents dropped first")
    p.add_argument("--update-fraction", type=float, default=0.05,
                   help="share of a chunk's logits sampled from and updated per iteration")
    p.add_argument("--chunk-size", type=int, default=100_000, help="documents per independently learned chunk")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and of DATAMASK")
    return p


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)

    load_before = os.getloadavg()
    start = time.perf_counter()
    emb, quality, labels = synthetic(a.docs, a.dim, a.clusters, a.seed)
    seconds_generate = time.perf_counter() - start
    print(f"[datamask_scale] generated {a.docs} × {a.dim} in {seconds_generate:.1f}s", flush=True)

    start = time.perf_counter()
    res = datamask(quality, emb, a.budget, lam=a.lam, groups=a.groups, iterations=a.iterations, lr=a.lr,
                   prune=a.prune, update_fraction=a.update_fraction, chunk_size=a.chunk_size, seed=a.seed)
    seconds_total = time.perf_counter() - start
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    curve = res.history.mean(0).tolist()  # mean over chunks
    at = plateau(curve)
    seconds_per_iter = res.seconds["learn"] / (a.iterations * len(res.history))  # one iteration of one chunk

    kept = np.sort(np.argsort(-quality, kind="stable")[: a.docs - int(a.prune * a.docs)])
    rng = np.random.default_rng(a.seed + 1)
    random_subset = rng.choice(kept, a.budget, replace=False)
    top_quality = np.argsort(-quality, kind="stable")[: a.budget]
    mean = emb[kept].mean(0, dtype=np.float64)
    compare = {
        name: {"mean_quality": round(float(quality[idx].mean()), 4),
               "mean_pairwise_cosine": round(mean_pairwise_cosine(emb, idx, mean), 5),
               "clusters_covered": int(len(np.unique(labels[idx])))}
        for name, idx in (("datamask", res.indices), ("random_after_pruning", random_subset),
                          ("top_quality", top_quality))
    }
    result = {
        "docs": a.docs, "dim": a.dim, "budget": a.budget, "groups": a.groups, "lam": a.lam, "lr": a.lr,
        "prune": a.prune, "update_fraction": a.update_fraction, "chunk_size": a.chunk_size, "chunks": len(res.history),
        "clusters": a.clusters, "seed": a.seed,
        "iterations": a.iterations,
        "plateau_iteration": at,
        "plateau_rule": "first T from which on the smoothed curve (window iterations/20) rises < 1% of |f(T)| "
                        "over ⌊0.9T⌋..T (f ≈ 0 for a random subset)",
        "seconds_generate": round(seconds_generate, 2),
        "seconds_total": round(seconds_total, 2),
        "seconds_per_iter": round(seconds_per_iter, 4),
        "seconds_at_plateau": None if at is None else round(
            seconds_total - res.seconds["learn"] + at * len(res.history) * seconds_per_iter, 1
        ),
        "seconds_stages": {k: round(v, 2) for k, v in res.seconds.items()},
        "peak_rss_gb": round(peak_rss_gb, 3),
        "threads": os.environ.get("OMP_NUM_THREADS", "default"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "final_objective": res.final_objective.tolist(),
        "selected": compare,
        "curve": [round(x, 6) for x in curve],
    }
    write_json(Path(a.out), result)
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=1))
    print("curve (every 10th):", [round(x, 4) for x in curve[::10]])
    return result


if __name__ == "__main__":
    main()
