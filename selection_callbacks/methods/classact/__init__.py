"""ClassAct: learnability selection, s(z) = ℓ_online(z) − ℓ_reference(z). The callback is in ``callback``; its card, ``README.md``, beside it."""

from selection_callbacks.methods.classact.callback import ClassActSelection

__all__ = ["ClassActSelection"]
