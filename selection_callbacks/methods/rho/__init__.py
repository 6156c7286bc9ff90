"""RHO-LOSS: keep the candidates with the largest reducible holdout loss, ℓ_learner(z) − ℓ_ref(z). The callback is in ``callback``; its card, ``README.md``, beside it."""

from selection_callbacks.methods.rho.callback import RhoLossSelection

__all__ = ["RhoLossSelection"]
