"""Optimizer maps: one optimizer step linearised in the fresh gradient, per group of same-shaped parameters.

``base`` (the ``OptimizerMap`` and ``StepMaps`` protocols, the registry optimizer class → map builder and
``register_map``), one module per optimizer (``sgd``, ``adamw``, ``muon``: each registers its builder on import,
which importing this package does) and ``step_maps`` (what a scoring call reads its maps from: the live
optimizer, plain gradients, GREATS' SGD step).
"""

# each registers its optimizer's map, in the order the supported optimizers are listed
from selection_callbacks.scoring.maps import sgd  # noqa: F401, I001
from selection_callbacks.scoring.maps import adamw, muon  # noqa: F401

__all__ = ["adamw", "base", "muon", "sgd", "step_maps"]
