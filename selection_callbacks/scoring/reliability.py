"""Split-half reliability of ghost utilities: do two disjoint halves of the target batch rank the candidates alike?

A candidate's utility u_i = ⟨G_i, Q(ḡ)⟩ is a noisy estimate: ḡ averages P target rows. Scoring the
same candidates against the first ⌊P/2⌋ rows (u^A) and against the rest (u^B) and taking
r = Spearman(u^A, u^B) measures how much of the ranking is signal rather than the noise of the target rows: r ≈ 0
means the utilities rank candidates at random, r → 1 that any target batch of this kind ranks them
the same. The full batch of P rows is more reliable than either half, about 2r/(1+r)
(Spearman–Brown).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch

from selection_callbacks.core.rank_correlation import spearman
from selection_callbacks.scoring.ghost.engine import GhostEngine, take_rows
from selection_callbacks.scoring.maps.base import StepMaps


def split_half_reliability(
    engine: GhostEngine,
    loss_fn: Callable[[MutableMapping], torch.Tensor],
    rows: MutableMapping,
    n_candidates: int,
    step_maps: Callable[[], StepMaps],
    seed: int = 0,
) -> float:
    """Spearman of the N candidates' utilities against target rows [N, N + P//2) and against [N + P//2, N + P).

    ``rows`` are the scoring rows (candidates then P ≥ 2 target rows); ``step_maps`` makes the step's maps
    afresh for each half (a map that reads the target gradient, as AdamW's before its first step does,
    sees only its half's). Two forward/backward passes of ``engine`` (best built without sketches: only
    the utilities are read). NaN where a half leaves fewer than 3 candidates with finite utilities.
    """
    n_rows = rows["input_ids"].shape[0]
    targets = n_rows - n_candidates
    if targets < 2:
        raise ValueError(f"split-half reliability needs ≥ 2 target rows, got {targets}")
    candidates, half = torch.arange(n_candidates), n_candidates + targets // 2
    halves = (torch.arange(n_candidates, half), torch.arange(half, n_rows))
    utilities = []
    for part in halves:
        scored = engine.score(loss_fn, take_rows(rows, torch.cat([candidates, part]), n_rows), n_candidates, step_maps(), seed)
        finite = torch.isfinite(scored.losses[:n_candidates])
        utilities.append(torch.where(finite, scored.utilities.float(), torch.nan).cpu())
    return spearman(*utilities)
