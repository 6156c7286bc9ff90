"""The second visible corpus: text shipped inside pip-installed packages, built offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selection_callbacks.cli import main as cli_main
from selection_callbacks.data.corpus_docs import CARD_FILE, MAX_DOC_BYTES, MIN_DOC_BYTES, SPLIT_FILES
from selection_callbacks.data.package_corpus import (
    DOMAINS,
    POOL_CAPS,
    TARGET_DOMAIN,
    build_package_corpus,
    domain_of,
    is_up_to_date,
)


def _read(out: Path) -> dict[str, list[dict]]:
    return {s: [json.loads(line) for line in (out / f).read_text(encoding="utf-8").splitlines()] for s, f in SPLIT_FILES.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("packages")
    card = build_package_corpus(out)
    return out, card, _read(out)


@pytest.mark.parametrize("path, domain", [
    ("torch/nn/modules/linear.py", "python"),
    ("numpy/__init__.pyi", "stubs"),
    ("torch/include/ATen/Tensor.h", "native"),
    ("yaml/_yaml.pyx", "native"),
    ("rich-15.0.0.dist-info/METADATA", "docs"),
    ("sklearn/datasets/descr/iris.rst", "docs"),
    ("pkg/README", "docs"),
    ("rich-15.0.0.dist-info/RECORD", "manifests"),
    ("rich-15.0.0.dist-info/LICENSE", "licenses"),
    ("numpy-2.4.6.dist-info/licenses/LICENSE.txt", "licenses"),
    ("matplotlib/mpl-data/fonts/afm/pagd8a.afm", "data"),
    ("pip/_vendor/requests/api.py", None),  # a vendored copy of another project
    ("torch/__pycache__/x.cpython-311.pyc", None),
    ("../../bin/wandb", None),
    ("torch/lib/libtorch.so", None),
])
def test_domain_of_paths(path: str, domain: str | None) -> None:
    assert domain_of(path) == domain


def test_splits_domains_and_sizes(built) -> None:
    _, card, docs = built
    assert {d["domain"] for d in docs["target"]} == {d["domain"] for d in docs["val"]} == {TARGET_DOMAIN}
    pool = card["splits"]["pool"]
    assert set(pool) == set(DOMAINS) and all(pool[d]["docs"] > 0 for d in DOMAINS)
    assert all(pool[d]["bytes"] <= POOL_CAPS[d] for d in DOMAINS)
    share = pool[TARGET_DOMAIN]["bytes"] / sum(v["bytes"] for v in pool.values())
    assert 0.05 < share < 0.25  # the target's domain is rare in the pool
    for split in docs.values():
        for d in split:
            assert MIN_DOC_BYTES <= len(d["text"].encode("utf-8")) <= MAX_DOC_BYTES
    texts = [d["text"] for split in docs.values() for d in split]
    assert len(texts) == len(set(texts))  # no text in two places


def test_held_out_projects_feed_nothing_to_the_pool(built) -> None:
    _, card, docs = built
    def project(doc):
        return doc["id"].split("/")[1]  # "<domain>/<project>/<path>#<i>"
    held = {project(d) for s in ("target", "val") for d in docs[s]}
    assert held and held.isdisjoint({project(d) for d in docs["pool"]})
    assert {project(d) for d in docs["target"]}.isdisjoint({project(d) for d in docs["val"]})
    assert len({project(d) for d in docs["target"]}) >= 3  # several projects, none dominating
    assert set(card["projects"]["target"]) == {project(d) for d in docs["target"]}
    assert all(card["installed"][p] == v for split in card["projects"].values() for p, v in split.items())


def test_build_is_reproducible_and_seeded(built, tmp_path) -> None:
    out, card, _ = built
    assert is_up_to_date(out, 0) and not is_up_to_date(out, 1)
    again = build_package_corpus(tmp_path / "again")
    assert again["sha256"] == card["sha256"]
    other = build_package_corpus(tmp_path / "seed1", seed=1)
    assert other["sha256"] != card["sha256"]


def test_cli_builds_and_prints_the_card(tmp_path, capsys) -> None:
    assert cli_main(["packages", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "| python |" in out and "- target:" in out and (tmp_path / "p" / CARD_FILE).exists()
