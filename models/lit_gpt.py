"""Old path of :mod:`selection_callbacks.learner.lit_gpt`, kept as an alias."""

from selection_callbacks._moved import alias

alias(__name__, "selection_callbacks.learner.lit_gpt")
