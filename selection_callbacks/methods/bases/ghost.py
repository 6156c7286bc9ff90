"""``GhostSelection``: the common plumbing of the ghost-gradient methods (OPUS, GREATS).

Per micro-batch: cut a seeded ``score_len`` window from each candidate, draw a fresh target batch
(windows of the target split, or of a user target file), run one ghost forward/backward over
[candidate windows ++ target windows] on the unwrapped module, and hand the utilities and
sketches (as ``features``) to the method's :meth:`calibrate`, which runs on the gathered
global superbatch under DDP. Under a compiled learner the scoring forward runs the learner's eager
modules (:func:`~selection_callbacks.scoring.ghost.eager.eager`: the capture's per-layer hooks do not
fire inside a compiled graph) while the training step stays compiled; under activation checkpointing
the capture ignores the backward's recomputation
(:class:`~selection_callbacks.scoring.ghost.capture.HookCapture`). At fit start one capture pass over the
first target rows, scoring nothing, checks that every scored layer is captured: a layer that does not run in
the loss's forward, or whose output does not reach the loss, is refused by name before the first step.
Every ``diagnostics_every`` selections it also measures how much the scores can be trusted: the split-half reliability of the utilities
(:mod:`selection_callbacks.scoring.reliability`) and the sketch's real error on a few candidates.
"""

from __future__ import annotations

import fnmatch
from abc import abstractmethod
from collections.abc import Callable, MutableMapping
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback, logs_this_step
from selection_callbacks.callbacks.protocols import needs_per_sample_loss, needs_target_batch
from selection_callbacks.core.rng import derived_seed, micro_batch_generator
from selection_callbacks.core.selection import Scores
from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.packing import PackedSplit, pack_source
from selection_callbacks.data.token_bin import load_token_bin
from selection_callbacks.nn.heads import vocabulary_size
from selection_callbacks.scoring.ghost.eager import compiled_modules, eager
from selection_callbacks.scoring.ghost.engine import FACTOR_TOLERANCE, GhostEngine, GhostScores, check_precision
from selection_callbacks.scoring.ghost.layers import scored_layers, tied_weights, unscorable_layers
from selection_callbacks.scoring.losses import per_sample_loss
from selection_callbacks.scoring.maps.base import StepMaps
from selection_callbacks.scoring.reliability import split_half_reliability
from selection_callbacks.scoring.windows import (
    candidate_windows,
    ignored_mask_problem,
    ignores_loss_mask,
    score_windows,
)


def excluded_layers(
    module: torch.nn.Module, include_embedding: bool, include_head: bool, patterns: list[str] | None
) -> tuple[str, ...]:
    """Names of the layers that match none of ``patterns`` (nothing when patterns is None): scorable layers
    (a tied weight's layers kept together when any of them matches) and layers the engine cannot score."""
    if patterns is None:
        return ()
    unscorable = unscorable_layers(module)
    layers = scored_layers(module, include_embedding, include_head, tuple(unscorable))
    names = [name for name, _ in layers]
    keep = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if not keep:
        raise ValueError(f"layers={patterns} match none of the scorable layers: {names}")
    keep |= {n for tied in tied_weights(layers) if keep & set(tied) for n in tied}
    return tuple(n for n in names if n not in keep) + tuple(
        n for n in unscorable if not any(fnmatch.fnmatchcase(n, p) for p in patterns))


def check_vocabulary(split: PackedSplit, model: torch.nn.Module, what: str) -> None:
    """Every token id of ``split`` is one the model's embedding has, or an error saying which and how to fix it."""
    vocab = vocabulary_size(model)
    top = int(split.tokens.max()) if len(split.tokens) else -1
    if vocab is not None and top >= vocab:
        raise ValueError(
            f"{what}: its tokens reach id {top}, but the model's vocabulary has {vocab} ids: tokenize it with the "
            "tokenizer the model was built for (the datamodule's `tokenizer`), or build the model with a larger vocab_size"
        )


def unoptimized_parameters(engine: GhostEngine, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of trainable parameters of the scored layers that no group of ``optimizer`` holds."""
    inner = optimizer.optimizers if hasattr(optimizer, "optimizers") else (optimizer,)
    held = {id(p) for opt in inner for g in opt.param_groups for p in g["params"]}
    return [f"{layer}.{name}" for layer, module in engine.layers for name, p in module.named_parameters(recurse=False)
            if p.requires_grad and id(p) not in held]


class GhostSelection(SelectionCallback):
    """Base of the ghost-gradient selection callbacks.

    Args:
        ratio: kept fraction ρ = K/N.
        score_len: tokens scored per candidate (a seeded random window).
        window_context: score each window after its prefix in the sequence, the target rows' too (the loss
            counted on the window only; the rows stay T tokens wide): set it when windows cut out of long
            sequences lose the meaning their context gives them; the scoring forward and backward then run
            over all T tokens. The learner's ``per_sample_loss`` must honour ``loss_mask`` (checked before the
            first step); not with ``target_file``, whose rows are packed as windows without a prefix.
        sketch_dim: m of the redundancy sketches (0: no interaction term).
        target_batch_size: target sequences drawn per micro-batch.
        target_file: a file of target rows (jsonl/parquet/text, or a .bin of pre-tokenized ids); default: the
            datamodule's target split.
        include_embedding: also score the token embedding: set it when what a candidate teaches the
            embedding rows should count (V rows wide, so scoring costs more).
        include_head: also score the output head (the same trade as ``include_embedding``).
        layers: glob patterns of module names to score (e.g. ``["blocks.3.*"]``); None = all of the
            above. The scoring backward stops at the earliest scored layer, so scoring only late
            layers is cheaper. A module with ≥ 2-D weights the engine has no form for (not a
            Linear, Conv1D or Embedding) must match none of the patterns; a tied head and
            embedding are kept together when a pattern names either.
        sketch: ``"tensor"``, ``"count"`` or ``"two_sided"`` (see :class:`GhostEngine`): ``"count"`` is the exact
            reference sketch, for measuring the default's error; it forms every P G_i and costs more.
        candidate_chunk: score candidates in passes of at most this many rows (the target rows ride
            with the first): activation memory flat in N (None: one pass over all rows, fastest).
        group_layers: score same-shaped layers of one optimizer group as one layer group (see :class:`GhostEngine`;
            None: the engine's default); False scores them one at a time, for less peak memory.
        factor_tolerance: AdamW layers are tensor-sketched through their rescaled rank-1 factors only where the
            factorisation's relative error ρ is at most this (0: P G_i always formed, an exact sketch of each
            layer at more cost; see :class:`GhostEngine`).
        sketch_check: candidates whose exact P G_i are formed to measure the sketch's real error
            (``select/sketch_error``, ``select/sketch_norm_bias``) on diagnostic selections (0 or fewer than 2: never,
            to spend nothing on the check).
        reliability: on diagnostic selections, also score the candidates against each half of the target
            rows (two sketch-free passes) and log the Spearman of the two rankings,
            ``select/utility_split_half`` (:mod:`selection_callbacks.scoring.reliability`; needs
            ``target_batch_size`` ≥ 2). Near 0 the utilities rank candidates at random in this run. False skips
            the two extra passes.
        diagnostics_every: selections between diagnostic ones (the first included). The diagnostics
            never change a selection; :meth:`summary` holds their history (``diagnostics``).
        temperature: τ of the sequential draws (0: greedy).
        seed: selection seed (windows, target draws, sampling).
        k: keep exactly this many instead of ratio·N.
        nonfinite: see :class:`SelectionCallback`.
        **fit_options: the base's fit options (``per_sample_keys``, ``whole_batch_keys``, ``strict_resume``,
            ``short_superbatch``; :class:`~selection_callbacks.callbacks.base.SelectionCallback`).
    """

    supported_stack = SelectionCallback.FULL_STACK

    def __init__(
        self,
        ratio: float = 0.5,
        score_len: int = 16,
        window_context: bool = False,
        sketch_dim: int = 512,
        target_batch_size: int = 8,
        target_file: str | None = None,
        include_embedding: bool = False,
        include_head: bool = False,
        layers: list[str] | None = None,
        sketch: str = "tensor",
        candidate_chunk: int | None = None,
        group_layers: bool | None = None,
        factor_tolerance: float = FACTOR_TOLERANCE,
        sketch_check: int = 8,
        reliability: bool = True,
        diagnostics_every: int = 100,
        temperature: float = 1.0,
        seed: int = 0,
        k: int | None = None,
        nonfinite: str = "error",
        **fit_options: Any,
    ) -> None:
        super().__init__(ratio=ratio, k=k, sampling="boltzmann", temperature=temperature, seed=seed, nonfinite=nonfinite,
                         diagnostics_every=diagnostics_every, **fit_options)
        if target_batch_size < 1:
            raise ValueError(f"target_batch_size must be ≥ 1, got {target_batch_size}")
        if reliability and target_batch_size < 2:
            raise ValueError(f"reliability=True splits the target rows in two halves: target_batch_size must be ≥ 2, "
                             f"got {target_batch_size} (or pass reliability=False)")
        if window_context and target_file is not None:
            raise ValueError("window_context=True scores each window after its prefix, but target_file rows are packed "
                             "as score_len windows without one: drop target_file (the target split's rows carry their "
                             "prefixes) or window_context")
        self.score_len, self.sketch_dim, self.target_batch_size = score_len, sketch_dim, target_batch_size
        self.window_context = window_context
        self.target_file, self.sketch, self.candidate_chunk = target_file, sketch, candidate_chunk
        self.group_layers = group_layers
        self.factor_tolerance, self.sketch_check, self.reliability = factor_tolerance, sketch_check, reliability
        self.diagnostics: list[dict[str, float]] = []  # one entry per diagnostic selection
        self.include_embedding, self.include_head = include_embedding, include_head
        if layers is not None and not layers:
            raise ValueError("layers must name at least one pattern (None scores every layer)")
        self.layers = list(layers) if layers is not None else None
        self.engine: GhostEngine | None = None
        self._halves_engine: GhostEngine | None = None
        self._target_file_split: PackedSplit | None = None
        self._last: GhostScores | None = None
        self._check: dict[str, float] | None = None  # this selection's diagnostics, if it was a diagnostic one

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_precision(trainer)
        module = getattr(pl_module, "model", None)
        module = module if isinstance(module, torch.nn.Module) else pl_module
        exclude = excluded_layers(module, self.include_embedding, self.include_head, self.layers)
        self.engine = GhostEngine(
            module, self.include_embedding, self.include_head, self.sketch_dim, self.sketch,  # type: ignore[arg-type]
            exclude=exclude, candidate_chunk=self.candidate_chunk, group_layers=self.group_layers,
            factor_tolerance=self.factor_tolerance,
        )
        if self.reliability:  # the split halves read only utilities
            self._halves_engine = GhostEngine(module, self.include_embedding, self.include_head, exclude=exclude,
                                              candidate_chunk=self.candidate_chunk, group_layers=self.group_layers)
        if self.target_file is not None:
            self._target_file_split = self._load_target_file(getattr(trainer, "datamodule", None))
            check_vocabulary(self._target_file_split, module, f"target_file={self.target_file}")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        compiled = compiled_modules(pl_module)
        if compiled:
            shown = ", ".join(name or type(pl_module).__name__ for name in compiled[:4]) + (" …" if len(compiled) > 4 else "")
            rank_zero_warn(f"{type(self).__name__} scores the learner's eager modules ({shown} run eager in the scoring "
                           "pass): the ghost capture's per-layer hooks do not fire inside a compiled graph; the "
                           "training step stays compiled")

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        who = type(self).__name__
        problems = needs_per_sample_loss(pl_module, who)
        if self.target_file is None:
            problems += needs_target_batch(getattr(trainer, "datamodule", None), who, "draws its target rows from the "
                                           "target split", "pass target_file=FILE")
        missing = unoptimized_parameters(self.engine, trainer.optimizers[0]) if self.engine and trainer.optimizers else []
        if missing:
            problems.append(
                f"{who} scores parameters the optimizer does not update: {missing[:8]}{' …' if len(missing) > 8 else ''}. "
                "torch.optim.Muon takes only 2-D matrices: use selection_callbacks.MuonWithAdamW (Muon on hidden "
                "matrices, AdamW on the rest), give these parameters an optimizer group, or leave their layers out "
                "with layers=[...]"
            )
        return problems

    @override
    def row_requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """What keeps the engine from capturing every scored layer of the learner's wiring, found by one capture pass
        (no scoring) over the first selection's target rows on the eager modules, under the Trainer's precision; the
        global RNGs (torch, numpy, Python) are restored after the draw and the pass, so the run's dropout, target rows
        and selections do not move."""
        if self.engine is None:
            return []
        with isolate_rng():
            rows = self._target_batch(trainer, 0, pl_module.device)
            with trainer.precision_plugin.train_step_context():
                problems = self.engine.capture_problems(lambda b: _eager_loss(pl_module, b), rows)
                if self.window_context and ignores_loss_mask(lambda b: _eager_loss(pl_module, b), rows):
                    problems.append(ignored_mask_problem("the learner's"))
                return problems

    def _load_target_file(self, dm: object) -> PackedSplit:
        """The target file packed in score_len windows with the training data's own tokenizer.

        A text target file needs that tokenizer (the datamodule's ``tokenizer``): encoded any other way
        its ids would mean other tokens than the model learned, so its absence is an error.
        """
        cache = str(getattr(dm, "cache_dir", None) or default_cache_dir())
        if getattr(dm, "pretokenized", False):
            if not str(self.target_file).endswith(".bin"):
                raise ValueError("the training data is pre-tokenized (.bin): the target file must be a .bin of the "
                                 "same ids")
            return load_token_bin(self.target_file, self.score_len, cache, dm.eot_id, name="target file")
        tokenizer = getattr(dm, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"target_file={self.target_file!r} is text and the datamodule ({type(dm).__name__}) has no `tokenizer` "
                "to encode it as the training data is encoded: give the datamodule a `tokenizer` attribute with "
                "encode_document(text) -> ids (ByteTokenizer for a byte-level model), or pass a pre-tokenized .bin "
                "target file"
            )
        return pack_source(self.target_file, self.score_len, cache, tokenizer, name="target file", progress=False)

    def _target_batch(self, trainer: L.Trainer, batch_idx: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The micro-batch's target rows: ``target_batch_size`` rows of the target file or split, each cut to a
        seeded ``score_len`` window. The seed labels ``"proxy"`` and ``"proxy-window"`` fix the draws: changing them
        would move every selection."""
        rng = np.random.default_rng(derived_seed(self.seed, trainer.current_epoch, batch_idx, "proxy"))
        if self._target_file_split is not None:
            split = self._target_file_split
            rows = split.batch(rng.choice(len(split), min(self.target_batch_size, len(split)), replace=False))
        else:
            dm = getattr(trainer, "datamodule", None)
            if not hasattr(dm, "target_batch"):
                raise ValueError(
                    f"{type(self).__name__} needs target sequences: pass target_file=FILE or use a datamodule with "
                    "target_batch(n, rng) (PoolDataModule reads --data.target)"
                )
            rows = dm.target_batch(self.target_batch_size, rng)
        gen = micro_batch_generator(self.seed, trainer.current_epoch, batch_idx, "proxy-window")
        return {k: v.to(device) for k, v in score_windows(rows, self.score_len, gen, context=self.window_context).items()}

    @abstractmethod
    def step_maps(self, trainer: L.Trainer, k: int) -> StepMaps:
        """The per-parameter map P of this step (K: sequences kept per micro-batch)."""

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> Scores:
        n, k = batch["input_ids"].shape[0], self.keep(batch["input_ids"].shape[0])
        cand = candidate_windows(batch, self.score_len, self.seed, trainer.current_epoch, batch_idx, trainer.global_rank,
                                 trainer.world_size, self.window_context)
        target = self._target_batch(trainer, batch_idx, cand["input_ids"].device)
        if ("labels" in cand) != ("labels" in target):
            raise ValueError("candidate and target batches must both carry 'labels' or both not")
        if target["input_ids"].shape[1] != cand["input_ids"].shape[1]:
            raise ValueError(
                f"target windows have {target['input_ids'].shape[1]} tokens, candidates {cand['input_ids'].shape[1]}; "
                f"target sequences must be at least score_len={self.score_len} long"
            )
        if "loss_mask" in cand or "loss_mask" in target:  # masked tokens stay out of the scores
            for part in (cand, target):
                part.setdefault("loss_mask", torch.ones_like(part["input_ids"], dtype=torch.float32))
        rows = {key: torch.cat([cand[key], target[key].to(cand[key].dtype)]) for key in cand}
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run: add the callback to the Trainer")
        diagnose = self.diagnostic_call()
        def loss_fn(b):
            return _eager_loss(pl_module, b)
        probe = self.sketch_check if diagnose else 0
        self._last = self.engine.score(loss_fn, rows, n, self.step_maps(trainer, k), self.seed, probe,
                                       factor_errors=logs_this_step(trainer))  # read only by the logged metrics
        self._count_passes(rows["input_ids"].numel())
        self._check = self._diagnose(trainer, k, loss_fn, rows, n) if diagnose else None
        return _scores_of(self._last, n, type(self).__name__)

    def _diagnose(
        self, trainer: L.Trainer, k: int, loss_fn: Callable[[MutableMapping], torch.Tensor], rows: dict[str, torch.Tensor], n: int
    ) -> dict[str, float]:
        """This selection's diagnostics: the split-half Spearman of the utilities and the probed sketch error."""
        check = {"step": float(trainer.global_step)}
        if self._halves_engine is not None and rows["input_ids"].shape[0] - n >= 2:
            check["utility_split_half"] = split_half_reliability(
                self._halves_engine, loss_fn, rows, n, lambda: self.step_maps(trainer, k), self.seed)
            self._count_passes(rows["input_ids"].numel() + n * rows["input_ids"].shape[1])  # each half with every candidate
        if self._last is not None and self._last.sketch_error:
            check["sketch_error"] = float(self._last.sketch_error["gram"])
            check["sketch_norm_bias"] = float(self._last.sketch_error["sq_norm"])
        self.diagnostics.append(check)
        return check

    def _count_passes(self, tokens: int) -> None:
        """One scoring forward of the learner over ``tokens`` window tokens, and its backward, which runs only
        through the layers from the earliest scored one on (``learner_reached``, see :meth:`flops_per_token`)."""
        self.meter.add("learner", "fwd", tokens)
        self.meter.add("learner_reached", "bwd", tokens)

    @override
    def flops_per_token(self) -> dict[str, int]:
        """The learner's forward FLOPs per token and, as ``learner_reached``, those of the layers the scoring
        backward runs through (the whole learner until the engine's first pass has measured them)."""
        flops = super().flops_per_token()
        reached = self.engine.backward_flops if self.engine is not None else None
        return {**flops, "learner_reached": flops["learner"] if reached is None else reached}

    @override
    def extra_metrics(self) -> dict[str, float]:
        if self._last is None:
            return {}
        out = {"select/utility_raw_std": float(self._last.utilities.std()) if self._last.utilities.numel() > 1 else 0.0,
               "select/target_loss": float(self._last.losses[self._last.utilities.shape[0]:].mean())}
        if self._last.relative_factor_error:  # AdamW layers: the rank-1 map's ρ, and how many sketches used it
            out["select/factor_rho"] = float(torch.stack(list(self._last.relative_factor_error.values())).mean())
            out["select/factored_layers"] = float(len(self._last.factored))
        if self._last.factored and self._last.factor_error:  # ‖D − r cᵀ‖/‖D‖ of the factored layers (not the sketch's error)
            out["select/factor_error"] = float(torch.stack([self._last.factor_error[n] for n in self._last.factored]).mean())
        return out

    @override
    def diagnostic_metrics(self) -> dict[str, float]:
        if self._check is None:
            return {}
        return {f"select/{key}": value for key, value in self._check.items() if key != "step"}

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        diagnostics = self.summary().get("diagnostics", {})
        shown = [f"{key.removesuffix('_mean').replace('_', ' ')} {value:.3f}" for key, value in diagnostics.items()
                 if key.endswith("_mean")]
        if shown:
            rank_zero_info(f"{type(self).__name__} diagnostics, mean over {diagnostics['checks']} diagnostic selections: "
                           + ", ".join(shown) + " (metrics.json: selection.diagnostics)")

    @override
    def summary(self) -> dict[str, Any]:
        """The base totals plus ``diagnostics``: the mean and last of each diagnostic and their history."""
        out = super().summary()
        if self.diagnostics:
            keys = sorted({key for check in self.diagnostics for key in check if key != "step"})
            values = {key: [c[key] for c in self.diagnostics if key in c and c[key] == c[key]] for key in keys}  # NaN left out
            out["diagnostics"] = {
                "checks": len(self.diagnostics),
                **{f"{key}_mean": sum(v) / len(v) for key, v in values.items() if v},
                **{f"{key}_last": v[-1] for key, v in values.items() if v},
                "history": self.diagnostics,
            }
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "diagnostics": [dict(c) for c in self.diagnostics]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.diagnostics = [dict(c) for c in state_dict.get("diagnostics", [])]  # absent in older checkpoints


def _eager_loss(pl_module: L.LightningModule, rows: MutableMapping) -> torch.Tensor:
    """The learner's per-row losses [R] from its eager modules (the compiled ones, if any, skipped for this forward)."""
    with eager(pl_module):
        return per_sample_loss(pl_module, rows)


def _scores_of(ghost: GhostScores, n: int, who: str) -> Scores:
    """Utilities [N] and sketches [N, m] of the candidates; a candidate whose loss is not finite scores NaN.

    A NaN or inf loss has no meaningful gradient, whatever number its utility came out as, so the
    base class's ``nonfinite`` policy decides (an error naming the samples, or ranked lowest and
    counted in ``select/nonfinite``). A non-finite target loss poisons the target direction of every
    candidate and is always an error.
    """
    losses = ghost.losses
    if not torch.isfinite(losses[n:]).all():
        bad = (~torch.isfinite(losses[n:])).nonzero().flatten().tolist()
        raise FloatingPointError(
            f"{who}: {len(bad)} target row(s) have a non-finite loss (rows {bad[:8]} of the target batch); every "
            "utility depends on the target gradient: check the model on the target data"
        )
    utilities = torch.where(torch.isfinite(losses[:n]), ghost.utilities.float(), torch.full_like(ghost.utilities.float(), float("nan")))
    return Scores(utilities, features=None if ghost.sketches is None else ghost.sketches.float())
