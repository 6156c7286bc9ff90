"""The installed wheel: ``pip wheel`` builds it from the sources, ``pip install --no-deps`` puts it (not
editable) into a fresh virtual environment, and there an AutoData search starts from the shipped recipe
presets and every subcommand of ``selection-callbacks`` prints its help.

The environment is made from the base interpreter with ``--system-site-packages``. The running
interpreter's site-packages (torch, Lightning, ...: the project's venv) join it through a ``.pth`` line
written after the install: a path line adds the folder without running the ``.pth`` files inside it, so
the editable install's import hook there never loads, and the wheel's copy, first on the path, is the one
imported (the script checks ``selection_callbacks.__file__``).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from tests.offline.test_offline_features import TINY_BANK, TINY_PROXY

ROOT = Path(__file__).resolve().parents[1]
PROXY_KEYS = ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "lr")

SCRIPT = r"""
import contextlib, io, json, sys
import selection_callbacks
from selection_callbacks.cli import build_parser, main

def paths(parser, prefix=()):
    action = parser._subcommands_action
    children = {} if action is None else action._name_parser_map
    return [prefix, *(p for name, child in children.items() for p in paths(child, (*prefix, name)))]

helps = {}
for path in paths(build_parser()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*path, "--help"])
            code = None
        except SystemExit as e:
            code = e.code
    helps[" ".join(path)] = {"code": code, "usage": "usage:" in out.getvalue()}
main(sys.argv[1:])
print(json.dumps({"file": selection_callbacks.__file__, "helps": helps}))
"""


def _build_and_install(tmp: Path, env: dict[str, str]) -> Path:
    """The wheel of this checkout installed into ``tmp/venv``; its interpreter."""
    src = tmp / "src"
    shutil.copytree(ROOT / "selection_callbacks", src / "selection_callbacks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                    str(src)], check=True, env=env, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("selection_callbacks-*.whl")
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=os.name != "nt").create(tmp / "venv")
    python = tmp / "venv" / ("Scripts" if os.name == "nt" else "bin") / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, env=env, cwd=tmp)
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, env=env, cwd=tmp, capture_output=True, text=True).stdout.strip()
    running = [*site.getsitepackages(), sysconfig.get_path("purelib")]
    (Path(venv_site) / "running_interpreter.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(running)))
    return python


def test_the_installed_wheel_searches_from_its_presets_and_every_subcommand_helps(tiny_corpus, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("PIP_")}
    python = _build_and_install(tmp_path, env)
    venv_root = python.parent.parent
    flags = [f"--proxy.{k}={getattr(TINY_PROXY, k)}" for k in PROXY_KEYS]
    flags += [f"--bank.proxy.{k}={getattr(TINY_BANK.proxy, k)}" for k in PROXY_KEYS]
    flags += [f"--bank.score_tokens={TINY_BANK.score_tokens}", f"--bank.clusters={TINY_BANK.clusters}",
              f"--bank.dsir.num_buckets={TINY_BANK.dsir.num_buckets}"]
    search = ["autodata", "search", "--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"],
              "--budget-docs", "80", "--out-dir", str(tmp_path / "search"), "--progress", "false", "--trials", "3",
              "--batch", "1", "--workers", "1", "--trial_tokens", "2048", "--reward_windows", "8",
              "--final_top", "1", "--final_seeds", "1", *flags]
    proc = subprocess.run([str(python), "-c", SCRIPT, *search], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).is_relative_to(venv_root) and "site-packages" in report["file"], report["file"]
    assert len(report["helps"]) > 10 and {"", "select dsir", "autodata search", "tokenizer"} <= set(report["helps"])
    assert all(h == {"code": 0, "usage": True} for h in report["helps"].values()), report["helps"]
    trials = [json.loads(line) for line in (tmp_path / "search" / "trials.jsonl").read_text().splitlines()]
    assert [t["status"] for t in trials] == ["ok"] * 3, trials
    assert [t["recipe"]["name"] for t in trials] == [
        "uniform random", "paper-core (AutoData Algorithm 2)", "paper-val-bpb (AutoData Algorithm 1)"]
    script = subprocess.run([str(python.parent / "selection-callbacks"), "corpus", "--help"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and "selection-callbacks [options] corpus --out OUT" in script.stdout, script.stderr[-2000:]
