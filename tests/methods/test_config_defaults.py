"""One source of truth: every value a configs/method/*.yaml sets is its class's default, except the value a
variant config exists to select."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs/method").glob("*.yaml"))
VARIANTS = {  # config → the init_args it selects on purpose (its opening comment says so)
    "classact_report.yaml": {"variant": "report"},
    "opus_greedy.yaml": {"temperature": 0.0},
    "rho_windows.yaml": {"score_len": 16},
}


def _selection(path: Path) -> tuple[type, dict]:
    selection = yaml.safe_load(path.read_text())["selection"]
    module, _, name = selection["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name), selection.get("init_args") or {}


def _defaults(cls: type) -> dict:
    """Every keyword a class takes with its default, following ``**kwargs`` up the bases as ``super().__init__``."""
    out: dict = {}
    for base in cls.__mro__:
        if "__init__" not in vars(base):
            continue
        parameters = list(inspect.signature(base.__init__).parameters.values())[1:]  # after self
        for p in parameters:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(p.name, p.default)
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return out


def test_every_method_config_is_checked() -> None:
    names = {p.name for p in CONFIGS}
    assert {"random.yaml", "rho.yaml", "classact.yaml", "opus.yaml", "greats.yaml"} <= names
    assert set(VARIANTS) <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_values_are_the_class_defaults(path: Path) -> None:
    cls, init_args = _selection(path)
    defaults = _defaults(cls)
    selected = VARIANTS.get(path.name, {})
    assert {key: init_args.get(key) for key in selected} == selected, f"{path.name} no longer selects {selected}"
    unknown = sorted(set(init_args) - set(defaults))
    assert not unknown, f"{path.name}: {cls.__name__} takes no {unknown}"
    differ = {key: (value, defaults[key]) for key, value in init_args.items()
              if key not in selected and value != defaults[key]}
    assert not differ, f"{path.name} vs {cls.__name__} defaults (yaml, class): {differ}"


@pytest.mark.parametrize("path", [ROOT / "configs/method" / name for name in VARIANTS], ids=lambda p: p.stem)
def test_a_variant_config_differs_from_the_defaults_only_in_what_it_selects(path: Path) -> None:
    cls, _ = _selection(path)
    defaults = _defaults(cls)
    for key, value in VARIANTS[path.name].items():
        assert defaults[key] != value, f"{path.name}: {key}={value!r} is the default; drop it from VARIANTS"
