"""What every selection method checks about a fit before its first step, beside its own ``requirements()``.

- :func:`fit_problems`: one selection callback, and the datamodule's K and ρ against the callback's.
- :func:`declared_keys`: the per-sample and whole-batch keys of the superbatches (the contract's, the
  datamodule's and the callback's ``per_sample_keys`` / ``whole_batch_keys``).
- :func:`undeclared_shape`: a datamodule that declares no ``batch_size`` (K) and ``ratio`` (ρ), so the
  superbatch's N cannot be checked against the callback's K before the first step.
- :func:`unrestorable_loaders`: train loaders without ``state_dict``/``load_state_dict``, which a run
  resumed from a mid-epoch checkpoint restarts from the epoch's first superbatch.
- :func:`drawn_target_rows`: one draw of ``target_batch`` for the methods that read target rows, checked.
- :func:`first_superbatch_problems`: the first superbatch's ids and its token entries against the target rows'.
- :func:`unfit_candidates`, :func:`without_unfit`, :func:`select_fit`: candidates with a NaN or inf
  anywhere in their per-sample rows, an error or left out of the choice.
- :class:`SuperbatchSizes` and :func:`drop_last_superbatch`: a superbatch of another N (an epoch's last,
  partial batch), warned about once or dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import CombinedLoader, rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng

from selection_callbacks.callbacks.protocols import TargetUse
from selection_callbacks.core.contract import CONTRACT_KEYS, SuperbatchError, nonfinite_rows
from selection_callbacks.core.rng import derived_seed
from selection_callbacks.core.sampling import SamplingRule
from selection_callbacks.core.selection import Choice, Scores, select
from selection_callbacks.core.target_rows import target_rows_problems, token_problems, unlike_target
from selection_callbacks.data.datamodule import candidates_per_rank

__all__ = [
    "SuperbatchSizes", "declared_keys", "declared_superbatch_size", "drawn_target_rows", "drop_last_superbatch",
    "first_superbatch_problems", "fit_problems", "resume_message", "select_fit", "undeclared_shape", "unfit_candidates",
    "unrestorable_loaders", "without_unfit",
]


def declared_keys(
    per_sample: Iterable[str], whole_batch: Iterable[str], datamodule: object
) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
    """The per-sample keys (the contract's, then the datamodule's and the callback's ``per_sample_keys``), the
    whole-batch keys (the datamodule's and the callback's ``whole_batch_keys``), and the problems of a key
    declared both ways."""
    keys = [*CONTRACT_KEYS, *(getattr(datamodule, "per_sample_keys", None) or ()), *per_sample]
    whole = [*(getattr(datamodule, "whole_batch_keys", None) or ()), *whole_batch]
    both = sorted(set(keys) & set(whole))
    problems = [f"{both} {'is' if len(both) == 1 else 'are'} declared both per-sample and whole-batch (the contract's "
                f"keys {list(CONTRACT_KEYS)} are always per-sample): declare each key one way"] if both else []
    return tuple(dict.fromkeys(keys)), tuple(dict.fromkeys(whole)), problems


def declared_superbatch_size(datamodule: object) -> int | None:
    """N per rank of a datamodule that declares its K and ratio (``batch_size``, ``ratio``, as PoolDataModule does):
    its ``superbatch_size``, else K/ρ; None when it declares neither."""
    k, ratio = getattr(datamodule, "batch_size", None), getattr(datamodule, "ratio", None)
    if isinstance(k, int) and isinstance(ratio, float | int) and 0 < ratio <= 1:
        return getattr(datamodule, "superbatch_size", None) or candidates_per_rank(k, ratio)
    return None


def fit_problems(selector: Any, selectors: list[str], datamodule: object) -> list[str]:
    """What is wrong with a fit of ``selector`` (a :class:`SelectionCallback`) before its first step, each with its
    fix ([] when nothing is); ``selectors`` names the Trainer's selection callbacks.

    - More than one selection callback on the Trainer: each would subset the rows the previous
      one kept (N → K → K² / N), so only one may run.
    - A datamodule that declares its K and ratio (``batch_size`` and ``ratio``, as
      :class:`PoolDataModule` does) whose superbatch N = K/ρ the callback would cut to another K.
    """
    problems = []
    if len(selectors) > 1:
        problems.append(f"the Trainer has {len(selectors)} selection callbacks ({', '.join(selectors)}); each would "
                        "subset what the previous one kept: pass exactly one")
    n = declared_superbatch_size(datamodule)
    if n is not None:
        k, ratio = datamodule.batch_size, datamodule.ratio
        try:
            kept = selector.keep(n)
        except SuperbatchError as e:
            kept, why = None, str(e)
        if kept != k:
            got = f"keeps K={kept}" if kept is not None else f"cannot keep any ({why})"
            problems.append(
                f"{type(datamodule).__name__} yields superbatches of N={n} to train on K={k} (ratio {ratio}), but "
                f"{type(selector).__name__} (ratio {selector.ratio}, k={selector.k}) {got}: give both the same ratio "
                f"(train.py links --data.ratio to the callback) or pass k={k}"
            )
    return problems


def undeclared_shape(datamodule: object) -> str | None:
    """The warning for a fit whose datamodule declares no ``batch_size``/``ratio`` (None when it declares both)."""
    missing = [name for name in ("batch_size", "ratio") if getattr(datamodule, name, None) is None]
    if not missing:
        return None
    where = ("the fit has no datamodule" if datamodule is None
             else f"the datamodule ({type(datamodule).__name__}) declares no {'/'.join(missing)}")
    return (f"{where}: the superbatch's N cannot be checked against the callback's K before the first step, and K "
            "follows each superbatch's N (K = round(ratio·N)); declare batch_size (K, rows trained per step) and ratio "
            "(ρ = K/N) on the datamodule, as PoolDataModule does")


def unrestorable_loaders(train_dataloader: Any) -> list[str]:
    """The train loaders Lightning cannot restore (no ``state_dict``/``load_state_dict`` of their own), each described."""
    if train_dataloader is None:
        return []
    found = []
    for loader in CombinedLoader(train_dataloader).flattened:
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            continue
        inner = [part for part in ("sampler", "batch_sampler", "dataset")
                 if callable(getattr(getattr(loader, part, None), "load_state_dict", None))]
        found.append(f"{type(loader).__name__}" + (f" (its {' and '.join(inner)} has load_state_dict, but Lightning "
                                                   "saves and restores only the loader's own)" if inner else ""))
    return found


def resume_message(loaders: list[str], who: str, strict: bool) -> str:
    """The warning (or, under ``strict_resume``, the error) for train loaders that cannot restore their position."""
    text = (f"{who}: the train loader ({', '.join(loaders)}) cannot restore its position, so a run resumed from a "
            "mid-epoch checkpoint re-serves the epoch's first superbatches: candidates train twice and the selections "
            "differ from the uninterrupted run's. Give the loader state_dict() and load_state_dict() (the epoch and the "
            "superbatches served; PoolDataModule's loader has them, docs/own-trainer.md shows one in 20 lines, "
            "torchdata's StatefulDataLoader is another)")
    return text if strict else text + ", or pass strict_resume=True to make this an error"


def drawn_target_rows(
    readers: list[TargetUse], datamodule: Any, vocab: int | None, seed: int
) -> tuple[Mapping[str, Any] | None, list[str]]:
    """One draw of ``target_batch(2, rng)`` when a method's requirements said it reads target rows (``readers``),
    and its problems (:func:`~selection_callbacks.core.target_rows.target_rows_problems`) in the first reader's words.

    The draw takes a generator of its own and runs under isolated global RNG states (torch, numpy,
    Python), so the rows a method draws later are those it would draw without the check. (None, [])
    when no method reads target rows or the datamodule has no ``target_batch`` (a requirement names that).
    """
    if not readers or not callable(getattr(datamodule, "target_batch", None)):
        return None, []
    with isolate_rng():
        rows = datamodule.target_batch(2, np.random.default_rng(derived_seed(seed, 0, 0, "target-check")))
    use = readers[0]
    problems = [f"{use.who} {use.why}, but the datamodule's ({type(datamodule).__name__}) target_batch(n, rng) "
                f"{problem}; or {use.instead}" for problem in target_rows_problems(rows, vocab)]
    return (None if problems else rows), problems


def first_superbatch_problems(batch: Mapping[str, Any], vocab: int | None, target: Mapping[str, Any] | None) -> list[str]:
    """The first superbatch's token ids outside the learner's vocabulary, and how its token entries differ from the
    target rows drawn when the fit started (when a method reads target rows)."""
    problems = [f"the superbatch {problem}" for problem in token_problems(batch, vocab)]
    return problems + (unlike_target(batch, target) if target is not None else [])


def unfit_candidates(rows: Mapping[str, Any], policy: str, who: str) -> torch.Tensor | None:
    """[G] bool of the candidates with a NaN or inf in one of their per-sample ``rows`` (None when none has).

    Under ``policy="error"`` they are an error naming the entries and the samples: training on such a
    row makes the step's loss non-finite whichever of its tokens a method scores. Under ``"lowest"`` a
    warning names the entries, and :func:`without_unfit` and :func:`select_fit` keep them out of the choice.
    """
    bad, where = nonfinite_rows(rows, list(rows))
    if bad is None:
        return None
    sample_id = rows.get("sample_id")
    ids = (sample_id.cpu()[bad] if isinstance(sample_id, torch.Tensor) else bad.nonzero().flatten()).tolist()[:8]
    if policy == "error":
        raise FloatingPointError(
            f"{who}: {int(bad.sum())} candidate(s) hold NaN/inf in {where}, e.g. samples {ids}: training on such a row "
            "makes the step's loss non-finite whichever of its tokens a method scores; clean the data, or set "
            "nonfinite='lowest' to leave such rows out of the choice"
        )
    rank_zero_warn(f"{who}: candidates with NaN/inf in {where} are left out of the choice (nonfinite='lowest')")
    return bad


def without_unfit(raw: Scores, unfit: torch.Tensor | None) -> Scores:
    """Scores whose ``unfit`` candidates are NaN, so the base class sets them aside as non-finite scores."""
    if unfit is None:
        return raw
    values = raw.values.float()
    return Scores(torch.where(unfit.to(values.device), torch.full_like(values, float("nan")), values),
                  raw.interactions, raw.features)


def select_fit(rule: SamplingRule, values: torch.Tensor, k: int, generator: torch.Generator,
               interactions: torch.Tensor | None, diagnose: bool, unfit: torch.Tensor | None, who: str) -> Choice:
    """:func:`~selection_callbacks.core.selection.select` over the candidates that are not ``unfit``, indices into all G.

    A rule that samples (Gumbel, Boltzmann, uniform) could draw a candidate ranked lowest; one with a
    non-finite row never trains. Fewer than K such candidates is an error.
    """
    if unfit is None:
        return select(rule, values, k, generator, interactions, diagnose)
    fit = (~unfit).nonzero().flatten()
    if fit.numel() < k:
        raise FloatingPointError(f"{who}: {int(unfit.sum())} of the {unfit.numel()} candidates hold NaN/inf, which "
                                 f"leaves {fit.numel()} to keep K={k}: clean the data")
    inner = interactions[fit][:, fit] if interactions is not None else None
    choice = select(rule, values[fit], k, generator, inner, diagnose)
    inclusion = None
    if choice.inclusion is not None:
        inclusion = torch.zeros(values.shape[0], dtype=choice.inclusion.dtype).index_copy(0, fit, choice.inclusion)
    return Choice(fit[choice.index], inclusion, choice.extras)


@dataclass
class SuperbatchSizes:
    """The loader's N (the datamodule's declared one, else the first superbatch's) and whether a superbatch of
    another N was warned about."""

    expected: int | None = None
    warned: bool = False

    def differs(self, n: int, k: int | None) -> int | None:
        """The loader's N when a superbatch of N=n trains another K than the others (a fixed ``k`` ≤ n does not)."""
        if self.expected is None:
            self.expected = n
        if n == self.expected or (k is not None and n >= k):
            return None
        return self.expected

    def warning(self, who: str, n: int, k_now: int, k_usual: int) -> str | None:
        """The one warning that K changes (None once it was given)."""
        if self.warned:
            return None
        self.warned = True
        return (f"{who}: a superbatch of N={n} candidates (the others have N={self.expected}, as an epoch's last, "
                f"partial batch has) trains K={k_now} rows instead of K={k_usual}: rows per step change; pass "
                "short_superbatch='drop' to drop an epoch's last, short superbatch (fixed K), or drop_last=True to the "
                "DataLoader")


def drop_last_superbatch(trainer: L.Trainer, n: int, expected: int, who: str) -> NoReturn:
    """End the epoch before its last, short superbatch trains, as Lightning does when a LightningModule's
    ``on_train_batch_start`` returns -1 (the batch counts as processed, none of its later hooks runs); a short
    superbatch mid-epoch is an error."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if not progress.is_last_batch:
        raise SuperbatchError(f"{who}: a superbatch of N={n} candidates arrived mid-epoch (the others have N={expected}); "
                              "short_superbatch='drop' drops only an epoch's last, partial superbatch: make the loader "
                              f"yield N={expected} rows each, or pass short_superbatch='train'")
    rank_zero_info(f"{who}: dropped the epoch's last superbatch (N={n} of {expected} candidates) to keep K fixed")
    progress.increment_by(0, is_last_batch=True)
    progress.increment_processed()
    raise StopIteration
