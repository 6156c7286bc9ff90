"""Old path of :mod:`selection_callbacks.scoring.proxy_models` (and of ``load_reference``, now in ``learner.reference``)."""

from selection_callbacks.learner.reference import load_reference  # noqa: F401
from selection_callbacks.scoring.proxy_models import *  # noqa: F401,F403
from selection_callbacks.scoring.proxy_models import __all__ as _names

__all__ = [*_names, "load_reference"]
