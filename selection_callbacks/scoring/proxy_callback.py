"""Old path of :mod:`selection_callbacks.callbacks.proxy`, kept as an alias."""

from selection_callbacks._moved import alias

alias(__name__, "selection_callbacks.callbacks.proxy")
