"""DATAMASK: joint quality–diversity subset selection by policy-gradient mask learning.

    python -m selection_callbacks.offline.select datamask --pool data/default/pool.jsonl \
        --target data/default/target.jsonl --budget-tokens 2000000 --out runs/datamask/subset.parquet

One logit L_i per document. A mask of S documents is drawn without replacement from softmax(L),
i.e. Gumbel-top-S of L; its ordered draw has the Plackett–Luce likelihood

    log P(o | L) = Σ_{k=1..S} [L_{o_k} − log Z_k],   Z_k = Σ_{j ∉ {o_1..o_{k−1}}} e^{L_j}.

The objective of a mask M is f(M) = λ·quality(M) + (1−λ)·diversity(M): quality is the mean
standardised quality score of M, diversity the negative mean pairwise cosine of the (centred, unit)
embeddings of M, or optionally facility location against a sampled reference set. Each iteration
draws G masks, turns f into group-normalised advantages A_j = (f_j − mean)/std and ascends
L ← L + η·(1/G)·Σ_j A_j ∇_L log P(o_j | L) (REINFORCE with a GRPO-style baseline).

The paper's engineering: the lowest-quality share of the pool is pruned first, L₀ is initialised
from quality, the pool is processed in independent random chunks (1M documents in the paper,
100k by default here, see ``datamask(chunk_size=...)``), and each iteration draws from and
updates only a random 5–10% of a chunk's logits. The final mask of a chunk is the best of G
draws from its learned logits.

:func:`datamask` works on plain arrays (quality [n], embeddings [n, d]); :func:`select_datamask`
has the offline-selector signature of ``offline.select`` (quality from the feature bank or from
cheap heuristics, a document or token budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from selection_callbacks.core.sampling import gumbel_noise
from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection
from selection_callbacks.offline.common.embeddings import make_embedder
from selection_callbacks.offline.common.features import FeatureConfig, feature_bank
from selection_callbacks.offline.common.quality import bank_quality, heuristic_quality, zscores

__all__ = [
    "DIVERSITIES", "DatamaskConfig", "DatamaskResult", "datamask", "gumbel_top_s",
    "mask_selection", "mask_sums", "pairwise_diversity", "plackett_luce_grad", "select_datamask",
]

DIVERSITIES = ("pairwise", "facility")
_ELEMENTS_PER_BLOCK = 1 << 24  # floats per temporary [masks, n] or [masks, S, R] block (64 MB)


@dataclass(frozen=True)
class DatamaskResult:
    """What :func:`datamask` returns.

    Attributes:
        indices: the selected documents, sorted ascending [S] (indices into the input arrays).
        logits: learned logits [n]; −inf for pruned documents.
        history: mean objective of the G sampled masks per iteration [chunks, iterations].
        final_objective: objective of each chunk's final mask [chunks].
        seconds: wall-clock of ``prepare`` (pruning, centring), ``learn`` (the iterations) and
            ``final`` (the final draws), summed over chunks.
    """

    indices: np.ndarray
    logits: np.ndarray
    history: np.ndarray
    final_objective: np.ndarray
    seconds: dict[str, float]


def pairwise_diversity(sums: torch.Tensor, sq_norms: torch.Tensor, size: int) -> torch.Tensor:
    """−mean_{i≠j} x_i·x_j of each mask from Σ_i x_i [G, d] and Σ_i ‖x_i‖² [G], in O(d) per mask.

    Σ_{i≠j} x_i·x_j = ‖Σ_i x_i‖² − Σ_i ‖x_i‖² (= ‖Σ x̂_i‖² − S for unit vectors).
    """
    if size < 2:
        return torch.zeros(sums.shape[0], dtype=torch.float64)
    off = sums.double().pow(2).sum(1) - sq_norms.double()
    return -off / (size * (size - 1))


def gumbel_top_s(logits: torch.Tensor, groups: int, size: int, rng: np.random.Generator) -> torch.Tensor:
    """G Plackett–Luce orders of ``size`` draws without replacement from softmax(logits): [G, size].

    Gumbel-top-S: the descending order of L_i + g_i, g_i = −log E_i with E_i ~ Exp(1) (float32
    :func:`~selection_callbacks.core.sampling.gumbel_noise` from ``rng``), is an ordered sample
    without replacement. Masks are drawn in blocks so that a [block, n] key matrix stays under 64 MB.
    """
    n = logits.shape[0]
    block = max(1, min(groups, _ELEMENTS_PER_BLOCK // n))
    out = []
    for start in range(0, groups, block):
        b = min(block, groups - start)
        keys = gumbel_noise((b, n), rng, torch.float32).add_(logits)
        out.append(torch.topk(keys, size, dim=1, sorted=True).indices)
    return torch.cat(out)


def mask_sums(idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Σ_{i ∈ mask} table_i for masks given as index rows [G, s] into ``table`` [n, d]: [G, d].

    A dense 0/1 mask matrix times the table (a GEMM, far faster than gathering G·s rows), in
    blocks of masks that keep the [block, n] matrix under 64 MB.
    """
    n = table.shape[0]
    block = max(1, _ELEMENTS_PER_BLOCK // n)
    out = []
    for start in range(0, idx.shape[0], block):
        rows = idx[start : start + block]
        m = torch.zeros(rows.shape[0], n, dtype=table.dtype).scatter_(1, rows, 1.0)
        out.append(m @ table)
    return torch.cat(out)


def plackett_luce_grad(logits: torch.Tensor, orders: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_g w_g ∇_L log P(o_g | L) for orders [G, S] over logits [n]; returns [n] (float64).

    With pos(j) the draw at which j was taken (S for documents not drawn) and c_k = Σ_{k'≤k} 1/Z_k,

        ∂ log P(o | L)/∂L_j = 1[j ∈ o] − e^{L_j} · c_{pos(j)},

    Z_k = R + Σ_{k'≥k} e^{L_{o_k'}}, R the undrawn mass (recomputed exactly for a mask whose
    undrawn mass is below 1e-6 of the total, where the subtraction would lose it). Each mask's
    gradient is formed densely and applied as a [G]×[G, n] product, so the drawn documents never
    suffer the cancellation of "−e^{L_j}c_S for all, then add back"; O(G·n) per call, in blocks of
    masks. Logits more than 600 below the largest count as 600 below (probabilities < e^{−600}),
    which keeps every e^{L} and 1/Z finite in float64.
    """
    lm = (logits.double() - logits.max()).clamp_min_(-600.0)
    e = lm.exp()
    total = e.sum()
    n = lm.shape[0]
    grad = torch.zeros(n, dtype=torch.float64)
    block = max(1, _ELEMENTS_PER_BLOCK // n)
    for start in range(0, orders.shape[0], block):
        o, w = orders[start : start + block], weights[start : start + block].double()
        drawn = e[o]  # [b, S]
        rest = total - drawn.sum(1)
        tight = rest < 1e-6 * total
        if tight.any():
            undrawn = torch.ones(int(tight.sum()), n, dtype=torch.bool).scatter_(1, o[tight], False)
            rest[tight] = torch.where(undrawn, e, 0.0).sum(1)
        c = (rest[:, None] + drawn.flip(1).cumsum(1).flip(1)).reciprocal_().cumsum(1)
        dense = e * -c[:, -1:]  # −e^{L_j}·c_S for the undrawn
        dense.scatter_(1, o, 1.0 - drawn * c)  # 1 − e^{L_j}·c_{pos(j)} for the drawn
        grad += w @ dense
    return grad


class _Objective:
    """f(M) = λ·mean quality + (1−λ)·diversity for the masks of one chunk."""

    def __init__(self, quality: torch.Tensor, emb: torch.Tensor, lam: float, diversity: str,
                 reference_size: int, rng: np.random.Generator) -> None:
        self.quality, self.emb, self.lam, self.kind = quality, emb, lam, diversity
        self.sq_norms = emb.pow(2).sum(1).double()
        if diversity == "facility":
            ref = torch.from_numpy(rng.choice(emb.shape[0], min(reference_size, emb.shape[0]), replace=False))
            self.ref_sims = emb @ emb[ref].T  # [n, R]

    def __call__(self, idx: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """f of masks [G] (float64); ``idx`` [G, s] indexes ``active`` (a subset of the chunk) or the chunk."""
        g, s = idx.shape
        rows = idx if active is None else active[idx]
        qual = self.quality[rows].mean(1)
        if self.lam == 1.0:
            return qual
        if self.kind == "pairwise":
            table = self.emb if active is None else self.emb.index_select(0, active)
            div = pairwise_diversity(mask_sums(idx, table), self.sq_norms[rows].sum(1), s)
        else:  # facility location: mean over references of the best cosine inside the mask
            r = self.ref_sims.shape[1]
            block = max(1, _ELEMENTS_PER_BLOCK // (s * r))
            div = torch.cat([
                self.ref_sims.index_select(0, rows[i : i + block].reshape(-1)).view(-1, s, r).amax(1).double().mean(1)
                for i in range(0, g, block)
            ])
        return self.lam * qual + (1.0 - self.lam) * div


def _unit_rows(rows: np.ndarray, center: bool) -> torch.Tensor:
    """A float32 copy of ``rows`` [n, d], optionally centred, each row scaled to unit norm (zero rows stay zero)."""
    x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    if np.shares_memory(x.numpy(), rows):
        x = x.clone()
    if center:
        x -= x.mean(0)
    norms = x.norm(dim=1, keepdim=True)
    if not torch.isfinite(norms).all():
        raise ValueError("embeddings have non-finite values")
    return x.div_(norms.clamp_min_(1e-12))


def _split_budget(budget: int, sizes: list[int]) -> list[int]:
    """Budget per chunk ∝ its size, largest remainders first, summing to ``budget``."""
    exact = np.asarray(sizes, dtype=np.float64) * budget / sum(sizes)
    out = np.floor(exact).astype(np.int64)
    out[np.argsort(-(exact - out), kind="stable")[: budget - int(out.sum())]] += 1
    return out.tolist()


def datamask(
    quality: np.ndarray, embeddings: np.ndarray, budget: int, *, lam: float = 0.3, groups: int = 128,
    iterations: int = 2000, lr: float = 10.0, prune: float = 0.4, update_fraction: float = 0.05,
    chunk_size: int = 100_000, diversity: str = "pairwise", reference_size: int = 256, center: bool = True,
    init_scale: float = 1.0, seed: int = 0, progress: bool = True,
) -> DatamaskResult:
    """Select ``budget`` of n documents by DATAMASK.

    Args:
        quality: a quality score per document [n] (higher is better; standardised inside).
        embeddings: document embeddings [n, d] (float32 is kept as is, no copy beyond one chunk).
        budget: S, documents to select (1 ≤ S ≤ n).
        lam: λ in f = λ·quality + (1−λ)·diversity; the paper prefers 0.1–0.5.
        groups: G, masks per iteration (the paper: 128 or 256).
        iterations: policy-gradient steps per chunk (see ``chunk_size``).
        lr: η, the logit step size.
        prune: share of the pool with the lowest quality dropped before learning (the paper: 0.4–0.5);
            never so much that fewer than S documents remain.
        update_fraction: share of a chunk's logits sampled from and updated per iteration (the
            paper: 0.05–0.1); each iteration's masks have S·fraction documents drawn from it.
        chunk_size: chunks of at most this many documents are learned independently, each
            selecting its share of S. The iterations a chunk needs grow about linearly with its
            size (each iteration's signal per logit scales with √(G/chunk)): raise ``iterations``
            with it.
        diversity: ``"pairwise"`` (−mean pairwise cosine) or ``"facility"`` (mean over a sampled
            reference set of the best cosine inside the mask).
        reference_size: reference documents per chunk for facility location.
        center: subtract the chunk's mean embedding before normalising (pairwise cosines of raw
            sentence embeddings share a large common component).
        init_scale: L₀ = init_scale·z(quality), i.e. initial sampling weights ∝ exp(init_scale·z).
        seed: every random draw derives from it.
        progress: show a tqdm bar over iterations.
    """
    quality = _checked_inputs(quality, embeddings, budget, lam, prune, update_fraction, groups, iterations,
                              chunk_size, diversity)
    how = _Learning(lam, groups, iterations, lr, update_fraction, diversity, reference_size, center, init_scale, progress)
    rng = np.random.default_rng(seed)
    seconds = dict.fromkeys(("prepare", "learn", "final"), 0.0)
    clock = time.perf_counter()
    candidates, z, parts, budgets = _plan_chunks(quality, budget, prune, chunk_size, rng)
    whole = len(parts) == 1 and candidates.size == quality.shape[0]
    logits = np.full(quality.shape[0], -np.inf)
    chosen, history, finals = [], [], []
    for c, (part, s) in enumerate(zip(parts, budgets)):
        idx = candidates[part]
        desc = f"datamask chunk {c + 1}/{len(parts)}" if len(parts) > 1 else "datamask"
        mask, lg, curve, final, clock = _learn_chunk(embeddings, idx, whole, z[part], s, how, rng, desc, seconds, clock)
        chosen.append(mask)
        logits[idx] = lg.numpy()
        history.append(curve)
        finals.append(final)
    return DatamaskResult(np.sort(np.concatenate(chosen)), logits, np.asarray(history), np.asarray(finals), seconds)


def _checked_inputs(
    quality: np.ndarray, embeddings: np.ndarray, budget: int, lam: float, prune: float, update_fraction: float,
    groups: int, iterations: int, chunk_size: int, diversity: str,
) -> np.ndarray:
    """``quality`` as float64 [n], or a ValueError naming the first argument of :func:`datamask` out of range."""
    quality = np.asarray(quality, dtype=np.float64)
    n = quality.shape[0]
    if quality.ndim != 1 or n == 0:
        raise ValueError(f"quality must be a non-empty vector [n], got shape {quality.shape}")
    if embeddings.ndim != 2 or embeddings.shape[0] != n:
        raise ValueError(f"embeddings must be [n={n}, d], got shape {embeddings.shape}")
    if not np.all(np.isfinite(quality)):
        raise ValueError("quality has non-finite values")
    if not 1 <= budget <= n:
        raise ValueError(f"budget must be between 1 and the pool size {n}, got {budget}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam (λ) must be in [0, 1], got {lam}")
    if not 0.0 <= prune < 1.0:
        raise ValueError(f"prune must be in [0, 1), got {prune}")
    if not 0.0 < update_fraction <= 1.0:
        raise ValueError(f"update_fraction must be in (0, 1], got {update_fraction}")
    if groups < 2 or iterations < 0 or chunk_size < 1:
        raise ValueError(
            f"need groups ≥ 2, iterations ≥ 0, chunk_size ≥ 1; got {groups}, {iterations}, {chunk_size}"
        )
    if diversity not in DIVERSITIES:
        raise ValueError(f"unknown diversity {diversity!r}; choose one of {DIVERSITIES}")
    return quality


@dataclass(frozen=True)
class _Learning:
    """The settings of :func:`datamask` that one chunk's learning reads."""

    lam: float
    groups: int
    iterations: int
    lr: float
    update_fraction: float
    diversity: str
    reference_size: int
    center: bool
    init_scale: float
    progress: bool


def _plan_chunks(
    quality: np.ndarray, budget: int, prune: float, chunk_size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[int]]:
    """Pruning and chunking: the kept documents (ascending), their standardised quality, each chunk's
    positions into the kept documents (a random split when they exceed ``chunk_size``) and its budget."""
    n = quality.shape[0]
    keep = max(budget, n - int(prune * n))
    candidates = np.sort(np.argsort(-quality, kind="stable")[:keep])
    z = zscores(quality[candidates])
    if keep > chunk_size:
        parts = np.array_split(rng.permutation(keep), -(-keep // chunk_size))
    else:
        parts = [np.arange(keep)]
    return candidates, z, parts, _split_budget(budget, [len(p) for p in parts])


def _learn_chunk(
    embeddings: np.ndarray, idx: np.ndarray, whole: bool, z: np.ndarray, size: int, how: _Learning,
    rng: np.random.Generator, desc: str, seconds: dict[str, float], clock: float,
) -> tuple[np.ndarray, torch.Tensor, list[float], float, float]:
    """One chunk (documents ``idx``; ``whole``: they are all of ``embeddings``, in order) learned and drawn.

    Returns its mask (indices into the input arrays), its learned logits (float64), the mean
    objective per iteration, the final mask's objective (the best of G draws from the learned
    logits) and the clock after the chunk's ``prepare``, ``learn`` and ``final`` time are counted.
    """
    emb = _unit_rows(embeddings if whole else embeddings[idx], how.center)
    q = torch.as_tensor(z)
    objective = _Objective(q, emb, how.lam, how.diversity, how.reference_size, rng)
    clock = _tick(seconds, "prepare", clock)
    lg, curve = _learn(q * how.init_scale, objective, size, how.groups, how.iterations, how.lr, how.update_fraction,
                       rng, desc, how.progress)
    clock = _tick(seconds, "learn", clock)
    orders = gumbel_top_s(lg.float(), how.groups, size, rng)
    f = objective(orders)
    best = int(torch.argmax(f))
    mask = idx[orders[best].numpy()]
    del emb, objective
    return mask, lg, curve, float(f[best]), _tick(seconds, "final", clock)


def _tick(seconds: dict[str, float], key: str, since: float) -> float:
    now = time.perf_counter()
    seconds[key] += now - since
    return now


def _learn(
    logits: torch.Tensor, objective: _Objective, size: int, groups: int, iterations: int, lr: float,
    update_fraction: float, rng: np.random.Generator, desc: str, progress: bool,
) -> tuple[torch.Tensor, list[float]]:
    """Policy-gradient iterations on one chunk; returns the logits (float64 [n]) and the mean f per iteration."""
    n = logits.shape[0]
    logits = logits.double().clone()
    active_n = n if update_fraction >= 1.0 else max(2, round(update_fraction * n))
    s = max(1, min(active_n, round(size * active_n / n)))
    curve = []
    bar = tqdm(range(iterations), desc=desc, unit="it", disable=not progress)
    for _ in bar:
        active = torch.from_numpy(np.sort(rng.choice(n, active_n, replace=False))) if active_n < n else None
        sub = logits if active is None else logits[active]
        orders = gumbel_top_s(sub.float(), groups, s, rng)  # [G, s] positions in the active set
        f = objective(orders, active)
        sd = f.std()
        adv = (f - f.mean()) / sd if sd > 0 else torch.zeros_like(f)
        step = lr * plackett_luce_grad(sub, orders, adv / groups)
        if active is None:
            logits += step
        else:
            logits.index_add_(0, active, step)
        curve.append(float(f.mean()))
        bar.set_postfix(f=f"{curve[-1]:.4f}", refresh=False)
    return logits, curve


@dataclass
class DatamaskConfig:
    """DATAMASK as an offline selector (the learning settings are :func:`datamask`'s).

    Attributes:
        lam: λ in f = λ·quality + (1−λ)·diversity (the paper: 0.1–0.5).
        groups: G, masks per iteration.
        iterations: policy-gradient steps per chunk.
        lr: logit step size.
        prune: lowest-quality share of the pool dropped before learning.
        update_fraction: share of a chunk's logits drawn from and updated per iteration.
        chunk_size: documents per independently learned chunk.
        diversity: ``pairwise`` or ``facility``.
        quality: ``features`` (the feature bank, :func:`bank_quality`; computed and cached on first
            use, which trains a small proxy on a sample of the pool) or ``heuristic``
            (:func:`heuristic_quality`).
        embedder: embeddings of the diversity term: ``auto`` (MiniLM when installed), ``minilm``, ``hashed``.
        bank: the feature bank's settings (the defaults share one cached bank with warmup_delta and policy).
    """

    lam: float = 0.3
    groups: int = 128
    iterations: int = 2000
    lr: float = 10.0
    prune: float = 0.4
    update_fraction: float = 0.05
    chunk_size: int = 100_000
    diversity: str = "pairwise"
    quality: str = "features"
    embedder: str = "auto"
    bank: FeatureConfig = field(default_factory=FeatureConfig)


def select_datamask(
    pool: Corpus, target: Corpus, budget: Budget, seed: int, cfg: DatamaskConfig, progress: bool = True
) -> Selection:
    """DATAMASK's mask, cut by the budget.

    A document budget is S. A token budget sets S = ⌈B / mean tokens of the candidates left after
    pruning⌉; the mask's documents by descending learned logit, then the other candidates by logit,
    then the pruned documents by quality, are cut by :meth:`Budget.take`, so the subset meets B
    exactly as the other selectors' do.
    """
    if cfg.quality not in ("features", "heuristic"):
        raise ValueError(f"quality must be 'features' or 'heuristic', got {cfg.quality!r}")
    start = time.perf_counter()
    embedder = make_embedder(cfg.embedder)
    emb = embedder.embed(pool.texts)
    if cfg.quality == "features":
        quality = bank_quality(feature_bank(pool, target, cfg.bank, progress=progress))
    else:
        quality = heuristic_quality(pool.texts, emb, embedder.embed(target.texts))
    seconds_inputs = time.perf_counter() - start
    selection = mask_selection(quality, emb, pool.n_tokens, budget, seed, cfg, progress)
    selection.info.update({"embedder": embedder.name, "seconds_embed_and_quality": round(seconds_inputs, 2)})
    return selection


def mask_selection(
    quality: np.ndarray, emb: np.ndarray, n_tokens: np.ndarray, budget: Budget, seed: int, cfg: DatamaskConfig,
    progress: bool = True,
) -> Selection:
    """DATAMASK on quality [D], embeddings [D, d] and tokens [D]: the ordering of :func:`select_datamask`, cut by the budget."""
    n = len(quality)
    by_quality = np.argsort(-quality, kind="stable")
    if budget.docs is not None:
        size = budget.docs
    else:
        size = min(n, -(-budget.tokens // int(n_tokens[by_quality[: n - int(cfg.prune * n)]].mean())))
    res = datamask(quality, emb, size, lam=cfg.lam, groups=cfg.groups, iterations=cfg.iterations, lr=cfg.lr,
                   prune=cfg.prune, update_fraction=cfg.update_fraction, chunk_size=cfg.chunk_size,
                   diversity=cfg.diversity, seed=seed, progress=progress)
    in_mask = np.zeros(n, dtype=bool)
    in_mask[res.indices] = True
    pruned = np.isinf(res.logits)
    order = np.concatenate([
        res.indices[np.argsort(-res.logits[res.indices], kind="stable")],
        np.flatnonzero(~in_mask & ~pruned)[np.argsort(-res.logits[~in_mask & ~pruned], kind="stable")],
        by_quality[pruned[by_quality]],
    ])
    chosen = budget.take(order, n_tokens)
    return Selection(chosen, {
        "mask_documents": int(size),
        "quality": cfg.quality,
        "seconds_datamask": {k: round(v, 2) for k, v in res.seconds.items()},
        "final_objective": res.final_objective.tolist(),
        "objective_first_last": res.history[:, [0, -1]].mean(0).tolist() if cfg.iterations else [],
    })
