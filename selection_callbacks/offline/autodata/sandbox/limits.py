"""The bounds of one code recipe in the sandbox (:mod:`selection_callbacks.offline.autodata.sandbox.runner`).

Example::

    limits = SandboxLimits(wall_seconds=30.0, cpu_seconds=20.0, memory_mb=1024)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SandboxLimits"]


@dataclass(frozen=True)
class SandboxLimits:
    """What one code recipe may use.

    Attributes:
        wall_seconds: wall-clock seconds from start to answer (the interpreter's start included).
        cpu_seconds: CPU seconds of the recipe (None = ``wall_seconds``).
        memory_mb: address space (MiB) the recipe may add to what the child maps after its imports.
    """

    wall_seconds: float = 60.0
    cpu_seconds: float | None = None
    memory_mb: int = 2048

    def __post_init__(self) -> None:
        if not (self.wall_seconds > 0 and (self.cpu_seconds is None or self.cpu_seconds > 0) and self.memory_mb > 0):
            raise ValueError(f"sandbox limits must be positive, got {self}")
