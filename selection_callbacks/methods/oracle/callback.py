"""Oracle: the labelled-domain reference, candidates from the target's domains first."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Literal

import lightning as L
import torch
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.protocols import needs_domain_names, needs_target_domains, target_domain_names
from selection_callbacks.core.rng import micro_batch_generator


class OracleDomainSelection(SelectionCallback):
    """Keep candidates whose ``domain`` label is one of the target's domains first, random within.

    Score = 1[domain ∈ target domains] + U(0, 1/2): top-K then takes every in-domain candidate
    (at random if there are more than K) and fills the rest at random. It reads only domain
    labels, which real pools rarely have: it is the upper reference the benchmark measures
    every method's gain against, not a method.

    Example::

        trainer = L.Trainer(callbacks=[OracleDomainSelection(ratio=0.5)])

    Args:
        ratio: kept fraction ρ = K/N.
        target_domains: domain names to prefer; by default the domains of the datamodule's
            target split (``trainer.datamodule.splits["target"].domain_names``): set it when the
            datamodule has no such split, its target split carries no domain labels, or another set
            of domains is wanted. Checked before the first step: given names must be among the
            datamodule's ``domain_names``, and some of the target split's must be.
        seed: seed of the random order within and outside the target domains.
        k: keep exactly this many instead of ratio·N: set it to fix K whatever the superbatch size.
        strict_resume, short_superbatch, per_sample_keys, whole_batch_keys: see :class:`SelectionCallback`.
    """

    supported_stack = SelectionCallback.FULL_STACK

    def __init__(
        self,
        ratio: float = 0.5,
        target_domains: list[str] | None = None,
        seed: int = 0,
        k: int | None = None,
        *,
        strict_resume: bool = False,
        short_superbatch: Literal["train", "drop"] = "train",
        per_sample_keys: list[str] | None = None,
        whole_batch_keys: list[str] | None = None,
    ) -> None:
        super().__init__(ratio=ratio, k=k, sampling="top_k", seed=seed, strict_resume=strict_resume,
                         short_superbatch=short_superbatch, per_sample_keys=per_sample_keys,
                         whole_batch_keys=whole_batch_keys)
        self.target_domains = target_domains

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        dm, who = getattr(trainer, "datamodule", None), type(self).__name__
        return needs_domain_names(dm, who) or needs_target_domains(dm, self.target_domains or None, who)

    def _wanted_codes(self, trainer: L.Trainer) -> list[int]:
        dm = getattr(trainer, "datamodule", None)
        names = dm.domain_names  # both checked in on_fit_start (requirements)
        wanted = set(self.target_domains or target_domain_names(dm) or ())
        return [i for i, name in enumerate(names) if name in wanted]

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        domain = batch.get("domain")
        if not isinstance(domain, torch.Tensor):
            raise ValueError(f"OracleDomainSelection reads each candidate's domain code, and the superbatch's 'domain' is "
                             f"{type(domain).__name__}: yield 'domain' as an integer tensor [N] of codes into the "
                             "datamodule's domain_names")
        in_target = torch.isin(domain.cpu(), torch.tensor(self._wanted_codes(trainer), dtype=domain.dtype))
        noise = torch.rand(domain.shape[0], generator=micro_batch_generator(self.seed, trainer.current_epoch, batch_idx, "oracle"))
        return in_target.float() + 0.5 * noise
