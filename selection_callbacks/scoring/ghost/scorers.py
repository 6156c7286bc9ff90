"""The registry of per-layer scorers: layer type → the function that scores a captured group of such layers.

A scorer is ``scorer(engine, names, state)``: ``names`` are captured layers of one type and shape (one group,
scored together when the group's last output gradient arrives), their captures in ``state.inputs`` and
``state.grads``, which the scorer pops. In the pass that carries the target rows it fixes the group's map and
utility vector in ``state.fixed[names]``; with candidates in the pass it adds their utilities per layer to
``state.utilities`` and their sketches, norms and probes to ``state``. ``linear`` registers ``nn.Linear``
(and transformers' ``Conv1D``, a Linear stored transposed), ``embedding`` ``nn.Embedding`` and ``tied``
:class:`TiedWeight`, the layers that share one weight (a head tied to the token embedding), whatever their types.

Example::

    @register_scorer(MyLinear)
    def score_my_linear(engine, names, state) -> None: ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.nn as nn

from selection_callbacks.nn.optim import conv1d_type
from selection_callbacks.scoring.ghost.state import PassState

if TYPE_CHECKING:
    from selection_callbacks.scoring.ghost.engine import GhostEngine

LayerScorer = Callable[["GhostEngine", tuple[str, ...], PassState], None]
SCORERS: dict[type, LayerScorer] = {}


class TiedWeight:
    """The registry key of the layers that share one weight: scored as one parameter, over all its uses."""


def register_scorer(*layer_types: type) -> Callable[[LayerScorer], LayerScorer]:
    """Registers the decorated scorer for ``layer_types`` (and their subclasses)."""

    def register(scorer: LayerScorer) -> LayerScorer:
        SCORERS.update(dict.fromkeys(layer_types, scorer))
        return scorer

    return register


def scorer_for(module: nn.Module) -> LayerScorer:
    """The scorer of ``module``'s type, the nearest registered class in its MRO. transformers' ``Conv1D`` takes the
    Linear scorer once transformers is loaded (the library never imports transformers itself).

    Raises:
        TypeError: no scorer is registered for the module's type.
    """
    conv1d = conv1d_type()
    if conv1d is not None and conv1d not in SCORERS:
        SCORERS[conv1d] = SCORERS[nn.Linear]
    for cls in type(module).__mro__:
        if cls in SCORERS:
            return SCORERS[cls]
    raise TypeError(f"no ghost scorer registered for {type(module).__name__}")
