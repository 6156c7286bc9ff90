"""The recipe sandbox: code recipes run in a fresh, kernel-confined interpreter.

``runner`` is the parent side (:func:`~selection_callbacks.offline.autodata.sandbox.runner.run_code`
starts the child, sends the recipe and the feature table, reads the indices back), ``limits`` its
bounds (:class:`~selection_callbacks.offline.autodata.sandbox.limits.SandboxLimits`), ``child`` the
script the fresh interpreter runs and ``guard`` the kernel confinement the child applies to itself
(rlimits, Landlock, seccomp; standard library only, imported by path).
"""

__all__ = ["child", "guard", "limits", "runner"]
