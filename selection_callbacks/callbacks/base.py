"""``SelectionCallback``: score a superbatch, keep K, hand the K rows to ``training_step``."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
import time
from dataclasses import dataclass
from collections.abc import MutableMapping
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from selection_callbacks.core.contract import SuperbatchError, per_sample_keys, subset_in_place, superbatch_size
from selection_callbacks.core.rng import micro_batch_generator
from selection_callbacks.core.sampling import effective_sample_size, make_rule


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


class SelectionCallback(L.Callback, ABC):
    """Base class of the online selection methods.

    In ``on_train_batch_start`` (once per micro-batch) it validates the dict superbatch of N
    candidates, computes ``score(...)`` [N], chooses K = round(ratio·N) (or ``k``) with the
    sampling rule, and subsets every per-sample entry of the batch *in place*, so the
    LightningModule's ``training_step`` sees exactly the K chosen rows. Randomness comes from
    a generator derived from (seed, epoch, batch index): no RNG state to checkpoint.

    Logged every micro-batch: ``select/overhead_ms``, ``select/kept_fraction``,
    ``select/score_mean``, ``select/score_std``, ``select/ess`` and ``select/domain/<name>``.

    Example::

        trainer = L.Trainer(callbacks=[HighLossSelection(ratio=0.5)], max_steps=100)
        trainer.fit(model, datamodule=PoolDataModule(..., batch_size=16, ratio=0.5))

    Args:
        ratio: kept fraction ρ = K/N in (0, 1].
        k: keep exactly this many per micro-batch instead (N < k is an error).
        sampling: ``"top_k"``, ``"gumbel"`` (Gumbel-top-K), ``"uniform"`` or ``"boltzmann"``
            (sequential draws with the method's interaction penalty; temperature 0 is greedy).
        temperature: Gumbel-top-K temperature in score units.
        seed: selection seed.
        nonfinite: ``"error"`` raises on NaN/inf scores; ``"lowest"`` ranks them below every
            finite score and logs ``select/nonfinite`` with a warning.
    """

    def __init__(
        self,
        ratio: float = 0.5,
        k: int | None = None,
        sampling: Literal["top_k", "gumbel", "uniform", "boltzmann"] = "top_k",
        temperature: float = 1.0,
        seed: int = 0,
        nonfinite: Literal["error", "lowest"] = "error",
    ) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"selection ratio must lie in (0, 1], got {ratio}")
        if k is not None and k < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        if nonfinite not in ("error", "lowest"):
            raise ValueError(f"nonfinite must be 'error' or 'lowest', got {nonfinite!r}")
        self.ratio, self.k, self.seed, self.nonfinite = ratio, k, seed, nonfinite
        self.sampling, self.temperature = sampling, temperature
        self.rule = make_rule(sampling, temperature)
        self.selections = 0
        self.candidates_seen = 0
        self.kept = 0
        self.overhead_seconds = 0.0
        self.domain_counts: dict[str, int] = {}
        self.last_selected: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None
        self.last_record: SelectionRecord | None = None

    # ---- what a method implements ----
    @abstractmethod
    def score(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int
    ) -> torch.Tensor | Scores:
        """Scores [N] of the candidates (runs under ``no_grad`` and the trainer's precision); higher is more wanted."""

    def calibrate(self, scores: Scores, k: int) -> Scores:
        """Global scores [G] (and interactions [G, G]) from the gathered raw ones; K here is W·K.

        Runs on every rank over the same gathered values, so calibrations that depend on the
        whole superbatch (standardising, interactions from ``features``) are identical to a
        single process with superbatch W·N. Default: unchanged.
        """
        return scores

    def after_selection(self, trainer: L.Trainer, pl_module: L.LightningModule, record: SelectionRecord) -> None:
        """Called on every rank after each selection (e.g. to train proxies on ``record.batch``)."""

    def extra_metrics(self) -> dict[str, float]:
        """Method-specific scalars logged with the ``select/*`` metrics of each micro-batch."""
        return {}

    # ---- the contract ----
    def keep(self, n: int) -> int:
        """K for a superbatch of N."""
        if self.k is not None:
            if n < self.k:
                raise SuperbatchError(f"superbatch has N={n} candidates, fewer than k={self.k}; raise N or lower k")
            return self.k
        return max(1, math.floor(self.ratio * n + 0.5))

    def _checked_scores(self, scores: torch.Tensor, n: int, batch: MutableMapping) -> tuple[torch.Tensor, int]:
        """Scores as float CPU [N] and the number of non-finite ones (error or ranked lowest)."""
        if not isinstance(scores, torch.Tensor) or scores.shape != (n,):
            raise ValueError(f"{type(self).__name__}.score returned {getattr(scores, 'shape', type(scores))}, expected [{n}]")
        scores = scores.detach().float().cpu()
        bad = ~torch.isfinite(scores)
        if bad.any():
            ids = batch.get("sample_id")
            where = ids[bad.to(ids.device)].tolist()[:8] if isinstance(ids, torch.Tensor) else bad.nonzero().flatten().tolist()[:8]
            if self.nonfinite == "error":
                raise FloatingPointError(
                    f"{type(self).__name__} produced {int(bad.sum())} non-finite score(s) (NaN/inf), e.g. samples {where}; "
                    "check the model's losses or set nonfinite='lowest' to rank them last"
                )
            rank_zero_warn(f"{int(bad.sum())} non-finite selection score(s) ranked lowest (samples {where})")
            finite = scores[~bad]
            floor = (finite.min() - 1.0) if finite.numel() else torch.tensor(0.0)
            scores = torch.where(bad, floor, scores)
        return scores, int(bad.sum())

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        start = time.perf_counter()
        n = superbatch_size(batch)
        k = self.keep(n)
        world, rank = trainer.world_size, trainer.global_rank
        with torch.no_grad(), trainer.precision_plugin.train_step_context():
            raw = self.score(trainer, pl_module, batch, batch_idx)
        raw = raw if isinstance(raw, Scores) else Scores(raw)
        self._check_shapes(raw, n, world)
        rows = {key: batch[key] for key in per_sample_keys(batch, n)}
        if world > 1:  # every rank gathers the W·N candidates and runs the same global selection
            raw = Scores(_gather(trainer, raw.values), None, _gather(trainer, raw.features))
            rows = {key: _gather(trainer, value) for key, value in rows.items()}
        scores = self.calibrate(raw, world * k)
        values, nonfinite = self._checked_scores(scores.values, world * n, rows)
        interactions = scores.interactions
        if interactions is not None:
            interactions = interactions.detach().float().cpu()
            if interactions.shape != (world * n, world * n) or not torch.isfinite(interactions).all():
                raise FloatingPointError(f"{type(self).__name__}: interactions must be finite [G, G] = [{world * n}, {world * n}]")
        generator = micro_batch_generator(self.seed, trainer.current_epoch, batch_idx)
        state = generator.get_state()
        index = self.rule.select(values, world * k, generator, interactions)
        extra = {}
        if interactions is not None:  # the same draws without the penalty: what the penalty changed
            plain = self.rule.select(values, world * k, torch.Generator().set_state(state), None)
            extra["select/redundancy_changed"] = 1.0 - len(set(index.tolist()) & set(plain.tolist())) / (world * k)
        inclusion = self.rule.inclusion(values, world * k, generator, interactions)
        domain_share = self._domain_share(trainer, rows, index)
        own = index[rank * k : (rank + 1) * k]
        if world == 1:
            subset_in_place(batch, own)
        else:  # this rank's K-slice of the gathered rows, replaced inside the dict
            batch.update({key: value[own.to(value.device)] for key, value in rows.items()})
        self.last_selected, self.last_scores = own, values  # positions in the global superbatch (= local when W = 1)
        self.last_record = SelectionRecord(
            step=trainer.global_step,
            micro_batch=batch_idx,
            epoch=trainer.current_epoch,
            world_size=world,
            rank_of=torch.arange(world).repeat_interleave(n),
            scores=values,
            selected=index,
            sample_id=rows["sample_id"].cpu() if isinstance(rows.get("sample_id"), torch.Tensor) else None,
            domain=rows["domain"].cpu() if isinstance(rows.get("domain"), torch.Tensor) else None,
            batch={key: v for key, v in rows.items() if isinstance(v, torch.Tensor)},
        )
        self.after_selection(trainer, pl_module, self.last_record)
        overhead = time.perf_counter() - start
        self.selections += 1
        self.candidates_seen += world * n
        self.kept += world * k
        self.overhead_seconds += overhead
        metrics = {
            "select/overhead_ms": 1000.0 * overhead,
            "select/kept_fraction": k / n,
            "select/score_mean": float(values.mean()),
            "select/score_std": float(values.std()) if values.numel() > 1 else 0.0,
            "select/ess": effective_sample_size(inclusion),
            **{f"select/domain/{name}": share for name, share in domain_share.items()},
            **extra,
            **self.extra_metrics(),
        }
        if nonfinite:
            metrics["select/nonfinite"] = float(nonfinite)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=k)

    def _check_shapes(self, raw: Scores, n: int, world: int) -> None:
        if not isinstance(raw.values, torch.Tensor) or raw.values.shape != (n,):
            raise ValueError(f"{type(self).__name__}.score returned {getattr(raw.values, 'shape', type(raw.values))}, expected [{n}]")
        if raw.features is not None and (raw.features.ndim != 2 or raw.features.shape[0] != n):
            raise ValueError(f"{type(self).__name__}.score features have shape {tuple(raw.features.shape)}, expected [{n}, m]")
        if raw.interactions is not None and world > 1:
            raise ValueError(
                f"{type(self).__name__} returned per-rank interactions, which cannot join a global selection under "
                "DDP: return Scores(values, features=...) and build the interactions in calibrate()"
            )

    def _domain_share(self, trainer: L.Trainer, batch: MutableMapping, index: torch.Tensor) -> dict[str, float]:
        domain = batch.get("domain")
        if not isinstance(domain, torch.Tensor):
            return {}
        names = getattr(getattr(trainer, "datamodule", None), "domain_names", None)
        codes = domain[index.to(domain.device)].tolist()
        shares: dict[str, float] = {}
        for code in codes:
            name = names[code] if names is not None and 0 <= code < len(names) else str(code)
            shares[name] = shares.get(name, 0.0) + 1.0 / len(codes)
            self.domain_counts[name] = self.domain_counts.get(name, 0) + 1
        return shares

    def summary(self) -> dict[str, Any]:
        """Totals of the run so far: counts, selection seconds and the domain share of the kept."""
        total = sum(self.domain_counts.values())
        return {
            "method": type(self).__name__,
            "selections": self.selections,
            "candidates_seen": self.candidates_seen,
            "kept": self.kept,
            "overhead_seconds": round(self.overhead_seconds, 4),
            "domains": {name: c / total for name, c in sorted(self.domain_counts.items())} if total else {},
        }

    # ---- checkpointing ----
    _COUNTERS = ("selections", "candidates_seen", "kept", "overhead_seconds")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**{c: getattr(self, c) for c in self._COUNTERS}, "domain_counts": dict(self.domain_counts)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for c in self._COUNTERS:
            setattr(self, c, type(getattr(self, c))(state_dict[c]))
        self.domain_counts = dict(state_dict["domain_counts"])


def _gather(trainer: L.Trainer, value: Any) -> Any:
    """[W·N, ...] concatenation of every rank's [N, ...] tensor (rank order); None stays None."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise SuperbatchError(
            f"DDP selection all-gathers the superbatch, but a per-sample entry is a {type(value).__name__}; "
            "carry per-sample data as tensors"
        )
    gathered = trainer.strategy.all_gather(value.to(trainer.strategy.root_device).contiguous())  # NCCL needs device tensors
    return gathered.reshape(-1, *value.shape[1:])
