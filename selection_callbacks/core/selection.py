"""The selection itself, without a Trainer: scores in, the chosen indices and inclusion probabilities out.

:func:`select` is what :class:`selection_callbacks.callbacks.base.SelectionCallback` runs on the
(gathered) scores of each micro-batch; a test or another framework calls it directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from selection_callbacks.core.contract import SuperbatchError
from selection_callbacks.core.sampling import SamplingRule

__all__ = ["Choice", "Scores", "SelectionRecord", "checked_interactions", "finite_scores", "keep_count", "select"]


@dataclass
class Scores:
    """What ``score`` may return instead of a plain [N] tensor: scores plus what joint selection needs.

    Attributes:
        values: [N] scores (higher is more wanted).
        interactions: [N, N] penalty I_ij subtracted from j's score once i is chosen (rules
            that draw sequentially use it; the others ignore it). Single-process only: under
            DDP a method returns ``features`` and builds the global interactions in ``calibrate``.
        features: [N, m] per-candidate vectors (e.g. gradient sketches) that are all-gathered
            with the scores and turned into interactions by the method's ``calibrate``.
    """

    values: torch.Tensor
    interactions: torch.Tensor | None = None
    features: torch.Tensor | None = None


@dataclass
class SelectionRecord:
    """One micro-batch's selection over the global superbatch of G = W·N candidates.

    Rank r's own candidates are rows [r·N, (r+1)·N); every rank holds the same record.

    Attributes:
        step: ``trainer.global_step`` when the micro-batch was selected.
        micro_batch: the batch index within the epoch.
        epoch: the epoch.
        world_size: W.
        rank_of: [G] the rank that drew each candidate.
        scores: [G] float CPU scores the rule saw (after ``calibrate``).
        selected: [W·K] indices into G in the rule's order; rank r trains on slice r.
        sample_id: [G] CPU candidate ids, if the batch carries them.
        domain: [G] CPU domain codes, if the batch carries them.
        batch: the global candidate rows (every per-sample tensor, on the training device),
            for methods that train proxies on the same data on every rank.
    """

    step: int
    micro_batch: int
    epoch: int
    world_size: int
    rank_of: torch.Tensor
    scores: torch.Tensor
    selected: torch.Tensor
    sample_id: torch.Tensor | None
    domain: torch.Tensor | None
    batch: dict[str, torch.Tensor]

    @property
    def selected_mask(self) -> torch.Tensor:
        """[G] bool: chosen by any rank."""
        mask = torch.zeros(self.scores.shape[0], dtype=torch.bool)
        mask[self.selected] = True
        return mask


@dataclass
class Choice:
    """What :func:`select` chose.

    Attributes:
        index: [k] indices into the scores, in the rule's order.
        inclusion: [N] inclusion probabilities π_i of the rule (for the ESS K²/Σπ²); None when not asked for.
        extras: scalars to log, e.g. ``select/redundancy_changed``: the share of the choice the
            interaction penalty changed against the same draws without it (only with the inclusion).
    """

    index: torch.Tensor
    inclusion: torch.Tensor | None
    extras: dict[str, float] = field(default_factory=dict)


def keep_count(n: int, ratio: float, k: int | None = None) -> int:
    """K for a superbatch of N: ``k`` when given (N < k is an error), else round-half-up(ρ·N).

    A ratio that rounds to K = 0 is an error rather than a silent K = 1 (which would train on
    1/N, not ρ, of the candidates).
    """
    if k is not None:
        if n < k:
            raise SuperbatchError(f"superbatch has N={n} candidates, fewer than k={k}; raise N or lower k")
        return k
    kept = math.floor(ratio * n + 0.5)
    if kept < 1:
        raise SuperbatchError(
            f"ratio={ratio} of a superbatch of N={n} rounds to K=0: raise N to ≥ {math.ceil(0.5 / ratio)} "
            "(e.g. the datamodule's batch_size/ratio) or pass k=1 to keep one row"
        )
    return kept


def finite_scores(
    scores: torch.Tensor, sample_id: object, policy: str, who: str
) -> tuple[torch.Tensor, int, list[int]]:
    """Float CPU scores [N] with non-finite ones handled by ``policy``; their count and (up to 8) ids.

    ``policy="error"`` raises a :class:`FloatingPointError` naming the samples (``sample_id`` [N]
    when a tensor, else positions); ``"lowest"`` puts them one below the lowest finite score.
    """
    scores = scores.detach().float().cpu()
    bad = ~torch.isfinite(scores)
    if not bad.any():
        return scores, 0, []
    if isinstance(sample_id, torch.Tensor):
        where = sample_id[bad.to(sample_id.device)].tolist()[:8]
    else:
        where = bad.nonzero().flatten().tolist()[:8]
    if policy == "error":
        raise FloatingPointError(
            f"{who} produced {int(bad.sum())} non-finite score(s) (NaN/inf), e.g. samples {where}; "
            "check the model's losses or set nonfinite='lowest' to rank them last"
        )
    finite = scores[~bad]
    floor = (finite.min() - 1.0) if finite.numel() else torch.tensor(0.0)
    return torch.where(bad, floor, scores), int(bad.sum()), where


def checked_interactions(interactions: torch.Tensor | None, g: int, who: str) -> torch.Tensor | None:
    """Interactions as float CPU [G, G], or an error when their shape is wrong or a value is not finite."""
    if interactions is None:
        return None
    interactions = interactions.detach().float().cpu()
    if interactions.shape != (g, g) or not torch.isfinite(interactions).all():
        raise FloatingPointError(f"{who}: interactions must be finite [G, G] = [{g}, {g}]")
    return interactions


def select(
    rule: SamplingRule,
    values: torch.Tensor,
    k: int,
    generator: torch.Generator,
    interactions: torch.Tensor | None = None,
    diagnose: bool = True,
) -> Choice:
    """Choose ``k`` of the N ``values`` with ``rule`` (drawing from ``generator``), and, with ``diagnose``, how.

    The generator is read in a fixed order: the rule's draws, then (for rules with a Monte-Carlo
    estimate) its inclusion draws, so the choice is the same with or without ``diagnose``. With
    interactions, the same draws are replayed without the penalty from a copy of the generator's
    state, to report what the penalty changed. Without ``diagnose`` neither the inclusion
    probabilities nor the replay are computed (for a sequential rule they cost about twice the choice).
    """
    state = generator.get_state()
    index = rule.select(values, k, generator, interactions)
    extras: dict[str, float] = {}
    if not diagnose:
        return Choice(index, None)
    if interactions is not None:
        plain = rule.select(values, k, torch.Generator().set_state(state), None)
        extras["select/redundancy_changed"] = 1.0 - len(set(index.tolist()) & set(plain.tolist())) / k
    inclusion = rule.inclusion(values, k, generator, interactions)
    return Choice(index, inclusion, extras)
