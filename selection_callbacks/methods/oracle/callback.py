"""Oracle: the labelled-domain reference, candidates from the target's domains first."""

from __future__ import annotations

from collections.abc import MutableMapping
import lightning as L
import torch
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.protocols import needs_domain_names
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
            target split carries no domain labels or another set of domains is wanted.
        seed: seed of the random order within and outside the target domains.
        k: keep exactly this many instead of ratio·N: set it to fix K whatever the superbatch size.
    """

    supported_stack = SelectionCallback.FULL_STACK

    def __init__(
        self, ratio: float = 0.5, target_domains: list[str] | None = None, seed: int = 0, k: int | None = None
    ) -> None:
        super().__init__(ratio=ratio, k=k, sampling="top_k", seed=seed)
        self.target_domains = target_domains

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        return needs_domain_names(getattr(trainer, "datamodule", None), type(self).__name__)

    def _wanted_codes(self, trainer: L.Trainer) -> list[int]:
        dm = getattr(trainer, "datamodule", None)
        names = getattr(dm, "domain_names", None)
        if names is None:
            raise ValueError("OracleDomainSelection needs a datamodule with domain_names (e.g. PoolDataModule)")
        wanted = self.target_domains or dm.splits["target"].domain_names
        return [i for i, name in enumerate(names) if name in set(wanted)]

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        domain = batch.get("domain")
        if not isinstance(domain, torch.Tensor):
            raise ValueError("OracleDomainSelection needs a 'domain' tensor in the superbatch")
        in_target = torch.isin(domain.cpu(), torch.tensor(self._wanted_codes(trainer), dtype=domain.dtype))
        noise = torch.rand(domain.shape[0], generator=micro_batch_generator(self.seed, trainer.current_epoch, batch_idx, "oracle"))
        return in_target.float() + 0.5 * noise
