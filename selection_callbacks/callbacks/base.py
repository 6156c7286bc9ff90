"""``SelectionCallback``: score a superbatch, keep K, hand the K rows to ``training_step``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, MutableMapping
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from selection_callbacks.callbacks.fit_checks import (
    SuperbatchSizes,
    declared_keys,
    declared_superbatch_size,
    drawn_target_rows,
    drop_last_superbatch,
    first_superbatch_problems,
    fit_problems,
    resume_message,
    select_fit,
    undeclared_shape,
    unfit_candidates,
    unrestorable_loaders,
    without_unfit,
)
from selection_callbacks.callbacks.protocols import target_batch_readers
from selection_callbacks.callbacks.stack import Stack, stack_problems
from selection_callbacks.core.contract import (
    CONTRACT_KEYS,
    SuperbatchError,
    per_sample_keys,
    subset_in_place,
    superbatch_size,
)
from selection_callbacks.core.costs import CostMeter
from selection_callbacks.core.domains import domain_names
from selection_callbacks.core.rng import micro_batch_generator
from selection_callbacks.core.sampling import effective_sample_size, make_rule
from selection_callbacks.core.selection import (
    Choice,
    Scores,
    SelectionRecord,
    checked_interactions,
    finite_scores,
    keep_count,
)
from selection_callbacks.nn.flops import matmul_flops_per_token
from selection_callbacks.nn.heads import vocabulary_size

__all__ = ["Scores", "SelectionCallback", "SelectionRecord", "logs_this_step"]


def logs_this_step(trainer: L.Trainer) -> bool:
    """Whether the Trainer writes this training step's logged values to its loggers: every ``log_every_n_steps``
    optimizer steps, every step under ``fast_dev_run`` (the check Lightning's LearningRateMonitor makes). A value
    handed to ``pl_module.log`` on another step reaches no logger, yet Lightning's result collection still moves
    it to the value's device (Lightning issue #20388), so the callbacks log only on these steps."""
    connector = getattr(trainer, "_logger_connector", None)
    return connector is None or bool(connector.should_update_logs) or bool(trainer.fast_dev_run)


class SelectionCallback(L.Callback, ABC):
    """Base class of the online selection methods.

    In ``on_train_batch_start`` (once per micro-batch) it validates the dict superbatch of N
    candidates, computes ``score(...)`` [N], chooses K = round(ratio·N) ≥ 1 (or ``k``) with the
    sampling rule, and subsets every per-sample entry of the batch *in place*, so the
    LightningModule's ``training_step`` sees exactly the K chosen rows. Randomness comes from
    a generator derived from (seed, epoch, batch index): no RNG state to checkpoint.

    Logged on the steps the Trainer writes to its loggers (every ``log_every_n_steps``,
    :func:`logs_this_step`), from that step's micro-batch: ``select/overhead_ms``, ``select/kept_fraction``,
    ``select/score_mean``, ``select/score_std`` and ``select/domain/<name>`` (the share of the
    chosen). :meth:`summary` totals the run, with each domain's share of the kept and its kept
    fraction (kept / candidates: 1 is kept always, ρ is random's rate). Diagnostics that cost time
    run on every ``diagnostics_every``-th selection (:meth:`diagnostic_call`; which selections those
    are survives a resume, and they never change a choice) and reach the loggers at that step only:
    ``select/ess`` (effective sample size K²/Σπ² of the inclusion probabilities, a Monte-Carlo
    estimate for the sampling rules), ``select/redundancy_changed`` where the method has an
    interaction penalty, and the method's own (:meth:`diagnostic_metrics`). The passes a method runs
    beside training are counted in ``meter`` (per model and kind) for its cost model
    (``cost`` and ``flops_per_token`` in :meth:`summary`).

    Example::

        trainer = L.Trainer(callbacks=[HighLossSelection(ratio=0.5)], max_steps=100)
        trainer.fit(model, datamodule=PoolDataModule(..., batch_size=16, ratio=0.5))

    Args:
        ratio: kept fraction ρ = K/N in (0, 1].
        k: keep exactly this many per micro-batch instead (N < k is an error): set it to fix K
            whatever the superbatch size.
        sampling: ``"top_k"``, ``"gumbel"`` (Gumbel-top-K), ``"uniform"`` or ``"boltzmann"``
            (sequential draws with the method's interaction penalty; temperature 0 is greedy).
        temperature: Gumbel-top-K temperature in score units.
        seed: selection seed.
        nonfinite: ``"error"`` raises on NaN/inf scores; ``"lowest"`` ranks them below every
            finite score and logs ``select/nonfinite`` with a warning: set ``"lowest"`` when a few
            rows' non-finite losses should not stop the run.
        diagnostics_every: selections between a method's costly diagnostics (the first selection
            included): lower it to see them more often, raise it to spend less time on them.
        per_sample_keys: batch entries that hold one row per candidate besides the contract's (``input_ids``,
            ``labels``, ``loss_mask``, ``sample_id``, ``domain``) and the datamodule's ``per_sample_keys``: each
            must have N rows and is cut to the K kept ones. An entry with N rows that no declaration names is an
            error, never a guess.
        whole_batch_keys: entries that belong to the whole superbatch (besides the datamodule's
            ``whole_batch_keys``): they pass through uncut whatever their length.
        strict_resume: raise before the first step, instead of warning, when the train loader cannot restore
            its position (no ``state_dict``/``load_state_dict``), since a resumed run would re-serve candidates.
        short_superbatch: a superbatch with another N than the loader's others (an epoch's last, partial batch):
            ``"train"`` keeps K = round(ρ·N) of it, with one warning that K changes; ``"drop"`` drops an epoch's
            last, short superbatch, so every step trains the same K rows.

    Before the first step it checks the fit beside each method's :meth:`requirements`, in one error
    (:mod:`~selection_callbacks.callbacks.fit_checks`: the datamodule's K and ρ, the declared keys, one
    draw of ``target_batch`` for methods that read target rows; at the first micro-batch the loader's
    resumability and the superbatch against the target rows). Candidates with a NaN or inf anywhere in
    their per-sample rows are an error under ``nonfinite="error"``; under ``"lowest"`` they score
    lowest and no rule chooses them (training on one would make the step's loss non-finite).

    ``supported_stack`` declares the training stacks a method serves (:mod:`~selection_callbacks.callbacks.stack`):
    the eager learner by default; methods that read the learner through ``per_sample_loss`` alone (or not at
    all) set ``FULL_STACK`` (compiled, FSDP2, activation checkpointing).
    """

    supported_stack: ClassVar[Stack] = Stack()
    FULL_STACK: ClassVar[Stack] = Stack(compiled=True, sharded=True, checkpointed=True)

    def __init__(
        self,
        ratio: float = 0.5,
        k: int | None = None,
        sampling: Literal["top_k", "gumbel", "uniform", "boltzmann"] = "top_k",
        temperature: float = 1.0,
        seed: int = 0,
        nonfinite: Literal["error", "lowest"] = "error",
        diagnostics_every: int = 100,
        *,
        per_sample_keys: list[str] | None = None,
        whole_batch_keys: list[str] | None = None,
        strict_resume: bool = False,
        short_superbatch: Literal["train", "drop"] = "train",
    ) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"selection ratio must lie in (0, 1], got {ratio}")
        if k is not None and k < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        if nonfinite not in ("error", "lowest"):
            raise ValueError(f"nonfinite must be 'error' or 'lowest', got {nonfinite!r}")
        if diagnostics_every < 1:
            raise ValueError(f"diagnostics_every must be ≥ 1, got {diagnostics_every}")
        if short_superbatch not in ("train", "drop"):
            raise ValueError(f"short_superbatch must be 'train' or 'drop', got {short_superbatch!r}")
        self.per_sample_keys, self.whole_batch_keys = list(per_sample_keys or []), list(whole_batch_keys or [])
        self.strict_resume, self.short_superbatch = strict_resume, short_superbatch
        self._per_sample: tuple[str, ...] = CONTRACT_KEYS  # the declared keys of this fit (set when it starts)
        self._whole_batch: tuple[str, ...] = ()
        self._target_rows: Mapping[str, Any] | None = None  # the target rows drawn when the fit starts
        self._sizes = SuperbatchSizes()
        self._first_batch_checked = False
        self.diagnostics_every = diagnostics_every
        self.ratio, self.k, self.seed, self.nonfinite = ratio, k, seed, nonfinite
        self.sampling, self.temperature = sampling, temperature
        self.rule = make_rule(sampling, temperature)
        self.selections = 0
        self.candidates_seen = 0
        self.kept = 0
        self.overhead_seconds = 0.0
        self.domain_counts: dict[str, int] = {}
        self.domain_candidates: dict[str, int] = {}
        self.last_selected: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None
        self.last_record: SelectionRecord | None = None
        self.last_diagnostics: dict[str, float] = {}  # this micro-batch's diagnostic scalars ({} on most)
        self.meter = CostMeter()
        self.learner_flops = 0  # the learner's forward matmul FLOPs per token, set when the fit starts

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
        """Method-specific scalars logged with the ``select/*`` metrics (computed only on the steps they are logged)."""
        return {}

    def diagnostic_metrics(self) -> dict[str, float]:
        """Scalars of this micro-batch's diagnostics, if it ran any ({} otherwise).

        Rank zero hands them to the trainer's loggers at this step only (``pl_module.log`` would
        repeat a value logged once on every later step).
        """
        return {}

    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """What this method needs from the model, the batch and the data that this fit lacks, each with its fix;
        checked once in ``on_fit_start`` (see :mod:`selection_callbacks.callbacks.protocols`); [] by default."""
        return []

    def row_requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """What only a pass over the checked target rows finds, run once every other check passed; [] by default."""
        return []

    def diagnostic_call(self) -> bool:
        """Whether the selection now being scored is one of every ``diagnostics_every`` (counted over the run)."""
        return self.selections % self.diagnostics_every == 0

    # ---- the contract ----
    def keep(self, n: int) -> int:
        """K for a superbatch of N."""
        return keep_count(n, self.ratio, self.k)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.learner_flops = matmul_flops_per_token(pl_module)
        datamodule = getattr(trainer, "datamodule", None)
        self._per_sample, self._whole_batch, problems = declared_keys(
            self.per_sample_keys, self.whole_batch_keys, datamodule)
        problems += fit_problems(self, [type(c).__name__ for c in trainer.callbacks if isinstance(c, SelectionCallback)],
                                 datamodule)
        with target_batch_readers() as readers:
            problems += self.requirements(trainer, pl_module)
        self._target_rows, found = drawn_target_rows(readers, datamodule, vocabulary_size(pl_module), self.seed)
        problems += found + stack_problems(trainer, pl_module, self.supported_stack, type(self).__name__)
        if not problems:  # a pass over target rows runs on rows that passed their checks
            problems = self.row_requirements(trainer, pl_module)
        if problems:
            raise ValueError(f"{type(self).__name__} cannot start:\n- " + "\n- ".join(problems))
        shape = undeclared_shape(datamodule)
        if shape is not None:
            rank_zero_warn(f"{type(self).__name__}: {shape}")
        self._sizes, self._first_batch_checked = SuperbatchSizes(declared_superbatch_size(datamodule)), False

    def _check_first_superbatch(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping) -> None:
        """Before the first selection: the train loader can restore its position (a warning, or an error under
        ``strict_resume``), and :func:`first_superbatch_problems`."""
        self._first_batch_checked = True
        who = type(self).__name__
        loaders = unrestorable_loaders(trainer.train_dataloader)
        if loaders and self.strict_resume:
            raise ValueError(resume_message(loaders, who, strict=True))
        if loaders:
            rank_zero_warn(resume_message(loaders, who, strict=False))
        problems = first_superbatch_problems(batch, vocabulary_size(pl_module), self._target_rows)
        if problems:
            raise SuperbatchError(f"{who} cannot select from the first superbatch:\n- " + "\n- ".join(problems))

    def _check_size(self, trainer: L.Trainer, n: int) -> None:
        """A superbatch that trains another K than the others: dropped when it is an epoch's last and short under
        ``short_superbatch="drop"``, else trained with one warning."""
        expected = self._sizes.differs(n, self.k)
        if expected is None:
            return
        if n < expected and self.short_superbatch == "drop":
            drop_last_superbatch(trainer, n, expected, type(self).__name__)
        warning = self._sizes.warning(type(self).__name__, n, self.keep(n), self.keep(expected))
        if warning is not None:
            rank_zero_warn(warning)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        start = time.perf_counter()
        diagnose = self.diagnostic_call()
        n = superbatch_size(batch, self._per_sample)
        keys = per_sample_keys(batch, n, self._per_sample, self._whole_batch)
        if not self._first_batch_checked:
            self._check_first_superbatch(trainer, pl_module, batch)
        self._check_size(trainer, n)
        k, world, rank = self.keep(n), trainer.world_size, trainer.global_rank
        raw, rows = self._scored_rows(trainer, pl_module, batch, batch_idx, keys)
        unfit = unfit_candidates(rows, self.nonfinite, type(self).__name__)  # the same gathered rows on every rank
        raw, bad = self._set_aside_nonfinite(without_unfit(raw, unfit), rows)
        scores = _restore_nonfinite(self.calibrate(raw, world * k), bad)
        values, nonfinite = self._checked_scores(scores.values, world * n, rows)
        interactions = checked_interactions(scores.interactions, world * n, type(self).__name__)
        generator = micro_batch_generator(self.seed, trainer.current_epoch, batch_idx)
        choice = select_fit(self.rule, values, world * k, generator, interactions, diagnose, unfit, type(self).__name__)
        domain_share = self._domain_share(trainer, rows, choice.index)
        own = choice.index[rank * k : (rank + 1) * k]
        if world == 1:
            subset_in_place(batch, own, keys)
        else:  # this rank's K-slice of the gathered rows, replaced inside the dict
            batch.update({key: value[own.to(value.device)] for key, value in rows.items()})
        self.last_selected, self.last_scores = own, values  # positions in the global superbatch (= local when W = 1)
        self.last_record = _record(trainer, batch_idx, n, values, choice.index, rows)
        self.after_selection(trainer, pl_module, self.last_record)
        overhead = time.perf_counter() - start
        self._count(world * n, world * k, overhead)
        if logs_this_step(trainer):
            pl_module.log_dict(self._metrics(overhead, k / n, values, domain_share, nonfinite), on_step=True, on_epoch=False,
                               batch_size=k)
        self.last_diagnostics = {**_choice_diagnostics(choice), **self.diagnostic_metrics()} if diagnose else {}
        if self.last_diagnostics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_diagnostics, step=trainer.global_step)

    def _scored_rows(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int, keys: list[str]
    ) -> tuple[Scores, dict[str, Any]]:
        """The raw scores and the per-sample rows ``keys``, gathered over the W ranks under DDP ([W·N] each)."""
        world, n = trainer.world_size, batch["input_ids"].shape[0]
        with torch.no_grad(), trainer.precision_plugin.train_step_context():
            raw = self.score(trainer, pl_module, batch, batch_idx)
        raw = raw if isinstance(raw, Scores) else Scores(raw)
        self._check_shapes(raw, n, world)
        rows = {key: batch[key] for key in keys}
        if world > 1:  # every rank gathers the W·N candidates and runs the same global selection
            raw = Scores(_gather(trainer, raw.values), None, _gather(trainer, raw.features))
            rows = {key: _gather(trainer, value) for key, value in rows.items()}
        return raw, rows

    def _set_aside_nonfinite(self, raw: Scores, rows: MutableMapping) -> tuple[Scores, torch.Tensor | None]:
        """Raw scores with non-finite candidates neutralised for :meth:`calibrate`, and their mask.

        Under ``nonfinite="error"`` a non-finite raw score raises here, naming the samples. Under
        ``"lowest"`` the calibration sees the finite scores' mean in their place and zero feature
        rows, so one bad candidate cannot turn a superbatch-wide calibration (standardising, a
        Gram matrix) non-finite; :func:`_restore_nonfinite` marks them again afterwards.
        """
        values = raw.values.detach()
        bad = ~torch.isfinite(values)
        if not bad.any():
            return raw, None
        finite_scores(values, rows.get("sample_id"), self.nonfinite, type(self).__name__)  # raises under "error"
        fill = values[~bad].float().mean() if (~bad).any() else torch.tensor(0.0)
        features = raw.features
        if features is not None:
            features = torch.where(bad.to(features.device)[:, None], torch.zeros_like(features), features)
        return Scores(torch.where(bad, fill.to(values.dtype), values), raw.interactions, features), bad

    def _checked_scores(self, scores: torch.Tensor, n: int, batch: MutableMapping) -> tuple[torch.Tensor, int]:
        """``calibrate``'s values as float CPU [W·N] and the number of non-finite ones (error or ranked lowest)."""
        if not isinstance(scores, torch.Tensor) or scores.shape != (n,):
            shape = getattr(scores, "shape", type(scores))
            raise ValueError(f"{type(self).__name__}.calibrate returned values of shape {shape}, expected [{n}]: "
                             "return one value per candidate of the gathered superbatch")
        scores, bad, where = finite_scores(scores, batch.get("sample_id"), self.nonfinite, type(self).__name__)
        if bad:
            rank_zero_warn(f"{bad} non-finite selection score(s) ranked lowest (samples {where})")
        return scores, bad

    def _count(self, candidates: int, kept: int, overhead: float) -> None:
        self.selections += 1
        self.candidates_seen += candidates
        self.kept += kept
        self.overhead_seconds += overhead

    def _metrics(
        self, overhead: float, kept_fraction: float, values: torch.Tensor, domain_share: dict[str, float], nonfinite: int,
    ) -> dict[str, float]:
        """The ``select/*`` scalars of one micro-batch."""
        metrics = {
            "select/overhead_ms": 1000.0 * overhead,
            "select/kept_fraction": kept_fraction,
            "select/score_mean": float(values.mean()),
            "select/score_std": float(values.std()) if values.numel() > 1 else 0.0,
            **{f"select/domain/{name}": share for name, share in domain_share.items()},
            **self.extra_metrics(),
        }
        if nonfinite:
            metrics["select/nonfinite"] = float(nonfinite)
        return metrics

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
        """Share of each domain among the chosen (0 for every domain seen so far and not chosen now): ``domain``
        as int codes [N] (named by the datamodule's ``domain_names``) or as N strings."""
        domain = batch.get("domain")
        if isinstance(domain, torch.Tensor):
            names = getattr(getattr(trainer, "datamodule", None), "domain_names", None)
            candidates = domain_names(domain.tolist(), names)
        elif isinstance(domain, list | tuple) and domain and all(isinstance(d, str) for d in domain):
            candidates = list(domain)
        else:
            return {}
        chosen = [candidates[i] for i in index.tolist()]
        for name in candidates:
            self.domain_candidates[name] = self.domain_candidates.get(name, 0) + 1
        shares = dict.fromkeys(self.domain_candidates, 0.0)  # every domain seen so far, so none keeps a stale share
        for name in chosen:
            shares[name] = shares.get(name, 0.0) + 1.0 / len(chosen)
            self.domain_counts[name] = self.domain_counts.get(name, 0) + 1
        return shares

    def flops_per_token(self) -> dict[str, int]:
        """Forward matmul FLOPs per token of each model the meter counts passes of (the learner's; proxies add theirs)."""
        return {"learner": self.learner_flops}

    def summary(self) -> dict[str, Any]:
        """Totals of the run so far: counts, selection seconds, each domain's share of the kept (``domains``)
        and its kept fraction, kept / candidates (``domain_kept_fraction``; random keeps ρ of every domain), the
        counted passes (``cost``: passes and tokens per model and kind; ``*_pretrain_*``: one-off) and
        ``flops_per_token``."""
        total = sum(self.domain_counts.values())
        return {
            "method": type(self).__name__,
            "selections": self.selections,
            "candidates_seen": self.candidates_seen,
            "kept": self.kept,
            "overhead_seconds": round(self.overhead_seconds, 4),
            "domains": {name: c / total for name, c in sorted(self.domain_counts.items())} if total else {},
            "domain_kept_fraction": {name: self.domain_counts.get(name, 0) / c
                                     for name, c in sorted(self.domain_candidates.items())},
            "cost": {key: {"passes": p, "tokens": t} for key, (p, t) in sorted(self.meter.total.items())},
            "flops_per_token": self.flops_per_token(),
        }

    # ---- checkpointing ----
    _COUNTERS = ("selections", "candidates_seen", "kept", "overhead_seconds")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**{c: getattr(self, c) for c in self._COUNTERS}, "domain_counts": dict(self.domain_counts),
                "domain_candidates": dict(self.domain_candidates), "cost": self.meter.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for c in self._COUNTERS:
            setattr(self, c, type(getattr(self, c))(state_dict[c]))
        self.domain_counts = dict(state_dict["domain_counts"])
        self.domain_candidates = dict(state_dict.get("domain_candidates", {}))  # a checkpoint without it: none counted
        self.meter.load_state_dict(state_dict.get("cost", {}))


def _record(
    trainer: L.Trainer, batch_idx: int, n: int, values: torch.Tensor, index: torch.Tensor, rows: dict[str, Any]
) -> SelectionRecord:
    """The :class:`SelectionRecord` of one micro-batch over the W·N gathered ``rows``."""
    world = trainer.world_size
    sample_id, domain = rows.get("sample_id"), rows.get("domain")
    return SelectionRecord(
        step=trainer.global_step,
        micro_batch=batch_idx,
        epoch=trainer.current_epoch,
        world_size=world,
        rank_of=torch.arange(world).repeat_interleave(n),
        scores=values,
        selected=index,
        sample_id=sample_id.cpu() if isinstance(sample_id, torch.Tensor) else None,
        domain=domain.cpu() if isinstance(domain, torch.Tensor) else None,
        batch={key: v for key, v in rows.items() if isinstance(v, torch.Tensor)},
    )


def _choice_diagnostics(choice: Choice) -> dict[str, float]:
    """``select/ess`` and the rule's extras of a diagnosed choice."""
    return {"select/ess": effective_sample_size(choice.inclusion), **choice.extras} if choice.inclusion is not None else {}


def _restore_nonfinite(scores: Scores, bad: torch.Tensor | None) -> Scores:
    """Calibrated scores with the set-aside candidates NaN again (ranked lowest and counted) and no interactions."""
    if bad is None:
        return scores
    values = torch.where(bad.to(scores.values.device), torch.full_like(scores.values, float("nan")), scores.values)
    interactions = scores.interactions
    if interactions is not None:
        keep = (~bad).to(interactions.device, interactions.dtype)
        interactions = interactions * keep[:, None] * keep[None, :]
    return Scores(values, interactions, scores.features)


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
