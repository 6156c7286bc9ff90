"""The third visible corpus: text shipped inside installed Debian packages, built from a dpkg database.

The build reads a fake Debian root made in tmp_path (a dpkg ``status`` file, ``info/<pkg>.list`` files and the
files they list), so it installs nothing and is the same on every machine.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from selection_callbacks.cli import main as cli_main
from selection_callbacks.data.corpus_docs import CARD_FILE, MAX_DOC_BYTES, MIN_DOC_BYTES, SPLIT_FILES
from selection_callbacks.data.debian_corpus import (
    DOMAINS,
    TARGET_DOMAIN,
    Sizes,
    build_debian_corpus,
    domain_of,
    is_up_to_date,
    parse_status,
    read_text,
)

WORDS = ("the kernel scheduler assigns each runnable task a share of processor time while buffers hold pages "
         "that the allocator returns to free lists under memory pressure").split()

# source package → its binary packages, each with (path, domain it must land in) of the files it ships
SOURCES = {
    f"doc{i}": {f"doc{i}-doc": [(f"/usr/share/doc/doc{i}-doc/guide{j}.rst", "prose") for j in range(3)]
                + [(f"/usr/share/doc/doc{i}-doc/html/_sources/page.rst.txt", "prose"),
                   (f"/usr/share/doc/doc{i}-doc/README.md.gz", "prose"),
                   (f"/usr/share/doc/doc{i}-doc/html/page.html", "markup"),
                   (f"/usr/share/doc/doc{i}-doc/copyright", "licenses"),
                   (f"/usr/share/doc/doc{i}-doc/changelog.Debian.gz", "changelogs")],
                f"libdoc{i}-dev": [(f"/usr/include/doc{i}/api{j}.h", "code") for j in range(2)]
                + [(f"/usr/share/man/man3/doc{i}_open.3.gz", "manpages"),
                   (f"/usr/share/doc/libdoc{i}-dev/copyright", "licenses")]}
    for i in range(8)
} | {
    f"tool{i}": {f"tool{i}": [(f"/usr/share/perl5/Tool{i}/Module{j}.pm", "code") for j in range(2)]
                 + [(f"/usr/share/man/man1/tool{i}.1.gz", "manpages"),
                    (f"/usr/share/info/tool{i}.info.gz", "prose"),
                    (f"/usr/share/i18n/locales/xx_XX{i}", "data"),
                    (f"/usr/share/nodejs/tool{i}/dist/tool.min.js", "data"),
                    (f"/usr/share/tool{i}/table.csv", "data"),
                    (f"/usr/share/xml/tool{i}/schema.xsd", "markup"),
                    (f"/usr/share/doc/tool{i}/NEWS.gz", "changelogs"),
                    (f"/usr/share/doc/tool{i}/copyright", "licenses")]}
    for i in range(6)
} | {
    "python3.11": {"python3.11-doc": [("/usr/share/doc/python3.11/html/_sources/tutorial.rst.txt", "prose")]},
    "wordlist": {"wamerican": [("/usr/share/dict/american-english", None)]},
}
SMALL = Sizes(pool={d: 40_000 for d in DOMAINS}, heldout={"target": 24_000, "val": 12_000}, per_source=10_000)


def _text(rng: random.Random, nbytes: int) -> str:
    paragraphs, size = [], 0
    while size < nbytes:
        paragraph = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 90)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


def make_root(root: Path) -> Path:
    """A fake Debian system: every binary package installed, with its files and dpkg's list of them."""
    rng = random.Random(0)
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    status = []
    for source, binaries in SOURCES.items():
        for package, files in binaries.items():
            status.append(f"Package: {package}\nStatus: install ok installed\nArchitecture: all\n"
                          f"Source: {source} (1.0-{len(source)})\nVersion: 1.0-{len(source)}+b1\n")
            listed = ["/.", "/usr", "/usr/share"]
            for path, _ in files:
                full = root / path.lstrip("/")
                full.parent.mkdir(parents=True, exist_ok=True)
                payload = _text(rng, rng.randint(1_000, 5_000)).encode()
                full.write_bytes(gzip.compress(payload) if path.endswith(".gz") else payload)
                listed.append(path)
            (info / f"{package}.list").write_text("\n".join(listed) + "\n")
    status.append("Package: removed-pkg\nStatus: deinstall ok config-files\nArchitecture: all\nVersion: 2\n")
    (root / "var/lib/dpkg/status").write_text("\n".join(status))
    (root / "etc").mkdir()
    (root / "etc/debian_version").write_text("12.11\n")
    return root


def _read(out: Path) -> dict[str, list[dict]]:
    return {s: [json.loads(line) for line in (out / f).read_text(encoding="utf-8").splitlines()] for s, f in SPLIT_FILES.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = make_root(tmp_path_factory.mktemp("debian-root"))
    out = tmp_path_factory.mktemp("debian")
    card = build_debian_corpus(out, root=root, sizes=SMALL)
    return root, out, card, _read(out)


@pytest.mark.parametrize("path, domain", [
    *[(path, domain) for binaries in SOURCES.values() for files in binaries.values() for path, domain in files],
    ("/usr/share/doc/linux-doc-6.1/html/_sources/admin-guide/mm.rst.txt", "prose"),
    ("/usr/share/perl/5.36.0/pod/perlfunc.pod", "prose"),
    ("/usr/share/common-licenses/GPL-3", "licenses"),
    ("/usr/share/gocode/src/github.com/spf13/cobra/LICENSE.txt", "licenses"),
    ("/usr/share/gocode/src/github.com/spf13/cobra/command.go", "code"),
    ("/usr/share/cargo/registry/serde-1.0.152/README.md", "prose"),
    ("/usr/share/man/de/man1/ls.1.gz", None),  # translated manual pages are left out
    ("/usr/share/unicode/UnicodeData.txt", "data"),
    ("/usr/share/doc/python3-doc/html/index.html", None),
    ("/usr/share/games/fortunes/fortunes", None),
    ("/usr/lib/x86_64-linux-gnu/libc.so.6", None),
    ("/usr/share/doc/git/RelNotes/2.39.0.txt", "prose"),
    ("/usr/share/doc/git/changelog.gz", "changelogs"),
    ("/usr/share/info/gettext.info-2.gz", "prose"),
    ("/usr/share/doc/tmux/README.gz", "prose"),
    ("/usr/share/doc/r-cran-brio/run-unit-test", None),  # a script without a suffix in a doc folder
])
def test_domain_of_paths(path: str, domain: str | None) -> None:
    assert domain_of(path) == domain


def test_status_keeps_installed_packages_with_their_source() -> None:
    text = ("Package: a\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1.2-3\nDescription: x\n y\n\n"
            "Package: b\nStatus: install ok installed\nArchitecture: all\nSource: bsrc (0.9-1)\nVersion: 0.9-1+b2\n\n"
            "Package: c\nStatus: deinstall ok config-files\nVersion: 4\n")
    a, b = parse_status(text)
    assert (a.name, a.source, a.source_version, b.source, b.source_version) == ("a", "a", "1.2-3", "bsrc", "0.9-1")


def test_read_text_decompresses_cuts_at_lines_and_refuses_binary(tmp_path) -> None:
    (tmp_path / "a.gz").write_bytes(gzip.compress(b"line one\nline two\n"))
    (tmp_path / "bin").write_bytes(b"ELF\x00\x01")
    (tmp_path / "latin1").write_bytes("caf\xe9".encode("latin-1"))
    assert read_text(tmp_path, "/a.gz") == "line one\nline two\n"
    assert read_text(tmp_path, "/bin") is None and read_text(tmp_path, "/latin1") is None
    (tmp_path / "long").write_text("x" * 100 + "\n" + "y" * 300_000 + "\n")
    assert read_text(tmp_path, "/long") == "x" * 100 + "\n"  # whole lines only


def test_splits_domains_and_sizes(built) -> None:
    _, _, card, docs = built
    assert {d["domain"] for d in docs["target"]} == {d["domain"] for d in docs["val"]} == {TARGET_DOMAIN}
    pool = card["splits"]["pool"]
    assert set(pool) == set(DOMAINS) and all(pool[d]["docs"] > 0 for d in DOMAINS)
    assert all(pool[d]["bytes"] <= SMALL.pool[d] for d in DOMAINS)
    for split, cap in SMALL.heldout.items():
        assert cap - MAX_DOC_BYTES < card["splits"][split][TARGET_DOMAIN]["bytes"] <= cap
    for split in docs.values():
        for d in split:
            assert MIN_DOC_BYTES <= len(d["text"].encode("utf-8")) <= MAX_DOC_BYTES
    texts = [d["text"] for split in docs.values() for d in split]
    assert len(texts) == len(set(texts))  # no text in two places


def test_held_out_sources_feed_nothing_to_the_pool(built) -> None:
    _, _, card, docs = built
    def source(doc):
        return doc["id"].split("/")[1]  # "<domain>/<source>/usr/...#<i>"
    held = {s: {source(d) for d in docs[s]} for s in ("target", "val")}
    assert held["target"] and held["val"] and held["target"].isdisjoint(held["val"])
    assert held["target"].isdisjoint({source(d) for d in docs["pool"]})
    assert held["val"].isdisjoint({source(d) for d in docs["pool"]})
    assert len(held["target"]) >= 3  # at most per_source of one source: several sources
    assert {s: set(card["sources"][s]) for s in held} == held
    assert card["sources"]["target"] == {s: f"1.0-{len(s)}" for s in sorted(held["target"])}


def test_left_out_material_never_appears(built) -> None:
    _, _, card, docs = built
    ids = [d["id"] for split in docs.values() for d in split]
    assert not any("python3.11" in i or "/dict/" in i for i in ids)
    assert "python3.11-doc" not in card["installed"] and "removed-pkg" not in card["installed"]
    assert card["installed"]["doc0-doc"] == "1.0-4+b1" and card["debian_version"] == "12.11"


def test_build_is_reproducible_seeded_and_kept_when_up_to_date(built, tmp_path) -> None:
    root, out, card, docs = built
    again = build_debian_corpus(tmp_path / "again", root=root, sizes=SMALL)
    assert again["sha256"] == card["sha256"]
    other = build_debian_corpus(tmp_path / "seed1", seed=1, root=root, sizes=SMALL)
    assert other["sources"]["target"] != card["sources"]["target"]
    assert is_up_to_date(out, 0, root, SMALL) and not is_up_to_date(out, 1, root, SMALL)
    assert not is_up_to_date(out, 0, root)  # the default sizes are another build
    assert json.loads((out / CARD_FILE).read_text())["sha256"] == card["sha256"]
    upgraded = make_root(tmp_path / "upgraded")
    status = upgraded / "var/lib/dpkg/status"
    status.write_text(status.read_text().replace("1.0-4+b1", "1.0-4+b2"))
    assert is_up_to_date(out, 0, make_root(tmp_path / "same"), SMALL)
    assert not is_up_to_date(out, 0, upgraded, SMALL)  # another installed version


def test_command_builds_and_refuses_a_root_without_dpkg(tmp_path, capsys) -> None:
    root = make_root(tmp_path / "root")
    assert cli_main(["debian", "--out", str(tmp_path / "out"), "--root", str(root)]) == 0
    assert "source packages" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="Debian system's root folder"):
        cli_main(["debian", "--out", str(tmp_path / "x"), "--root", str(tmp_path)])
