"""The house's shape: layers import only downward, no alias modules, functions stay short."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "selection_callbacks"
FRAMEWORK_FREE = ("core", "scoring", "nn")  # and data/, except its datamodule


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(*packages: str) -> list[str]:
    """Importable library modules under ``packages`` (all of the library when empty), ``__main__`` left out."""
    roots = [LIBRARY / p for p in packages] if packages else [LIBRARY]
    paths = [p for root in roots for p in sorted(root.rglob("*.py"))]
    return [_module_name(p) for p in paths if p.name != "__main__.py"]


def _imported_after(modules: list[str]) -> set[str]:
    """Top-level package names in ``sys.modules`` after a fresh interpreter imports ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_framework_free_layers_never_import_lightning() -> None:
    data = [m for m in _modules("data") if m != "selection_callbacks.data.datamodule"]
    modules = _modules(*FRAMEWORK_FREE) + data
    assert "selection_callbacks.core.selection" in modules and "selection_callbacks.scoring.ghost.engine" in modules
    loaded = _imported_after(modules)
    assert "selection_callbacks" in loaded
    assert not loaded & {"lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics"}, sorted(loaded)


def test_the_library_never_imports_models() -> None:
    loaded = _imported_after(_modules())
    assert "lightning" in loaded  # the whole library was imported
    assert "models" not in loaded


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_library_function_is_longer_than_60_lines() -> None:
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in sorted(LIBRARY.rglob("*.py"))
            for name, line, n in _functions(p) if n > 60]
    assert not long, long


def test_every_package_declares_its_public_names() -> None:
    for init in sorted(LIBRARY.rglob("__init__.py")):
        module = importlib.import_module(_module_name(init))
        assert isinstance(getattr(module, "__all__", None), list), init
        for name in module.__all__:
            assert hasattr(module, name) or importlib.util.find_spec(f"{module.__name__}.{name}"), (init, name)


@pytest.mark.parametrize("name", importlib.import_module("selection_callbacks").__all__)
def test_the_top_level_exports_every_callback(name: str) -> None:
    import lightning as L

    import selection_callbacks

    value = getattr(selection_callbacks, name)
    assert value.__name__ == name
    if name.endswith(("Selection", "Ledger", "Dashboard", "Recorder")):
        assert issubclass(value, L.Callback), name


LAYERS = ("core", "data", "nn", "scoring", "offline", "callbacks", "methods", "cli")  # bottom to top


def test_each_layer_imports_only_downward() -> None:
    upward = []
    for path in sorted(LIBRARY.rglob("*.py")):
        own = path.relative_to(LIBRARY).parts[0]
        if own not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "selection_callbacks" and len(parts) > 1 and parts[1] in LAYERS:
                    if LAYERS.index(parts[1]) > LAYERS.index(own):
                        upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward


def test_no_module_only_re_exports_another() -> None:
    """An alias module (a file whose body only imports another module's names) is dead weight: import the real one."""
    aliases = []
    for path in sorted([*LIBRARY.rglob("*.py"), *(ROOT / "models").rglob("*.py")]):
        if path.name == "__init__.py":
            continue
        body = [n for n in ast.parse(path.read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if body and all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign)) for n in body):
            aliases.append(str(path.relative_to(ROOT)))
    assert not aliases, aliases


def test_no_library_file_is_longer_than_500_lines() -> None:
    """A longer module says why it is one piece in its opening docstring ("one piece")."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted(LIBRARY.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500 and "one piece" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not long, long
