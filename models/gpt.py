"""Old path of :mod:`selection_callbacks.nn.gpt`, kept as an alias."""

from selection_callbacks._moved import alias

alias(__name__, "selection_callbacks.nn.gpt")
