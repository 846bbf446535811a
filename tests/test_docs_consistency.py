"""One home for each number: the README's results summary repeats BENCHMARKS.md's status table and nothing else.

BENCHMARKS.md opens with a ``## Status`` section whose tables have the columns ``target | current value | verdict |
date | entry``, one row per target. The README's ``## Results`` section may repeat rows of it, in tables with the same
columns; every such row must name a target of the status table and give its value, verdict and date unchanged, and
its entry link must point at the same BENCHMARKS.md heading. Every ``#anchor`` link into BENCHMARKS.md (from either
file) must resolve to one of its headings, and every scheme the README names as a prefill or decode scheme must be one
the scheme registry (``sparse_models.schemes.registry.scheme_names``) has.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()
README = (REPO / "README.md").read_text()

COLUMNS = ("target", "current value", "verdict", "date", "entry")
VERDICTS = {"met", "missed"}


def _strip_fences(text: str) -> str:
    """The text without fenced code blocks (a ``# comment`` in a bash block is not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _section(text: str, heading: str) -> str:
    """The body of the level-2 section ``## heading`` (up to the next level-2 heading), or ''."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", _strip_fences(text), flags=re.S | re.M)
    return match.group(1) if match else ""


def _cells(line: str) -> list[str]:
    return [" ".join(c.split()) for c in line.strip().strip("|").split("|")]


def status_rows(text: str) -> list[dict[str, str]]:
    """Rows of every table in ``text`` whose header is exactly :data:`COLUMNS` (other tables are skipped)."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = tuple(c.lower() for c in cells)
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        if header == COLUMNS:
            assert len(cells) == len(COLUMNS), f"a status row with {len(cells)} cells: {line}"
            rows.append(dict(zip(COLUMNS, cells)))
    return rows


def anchor_of(entry: str) -> str | None:
    """The ``#anchor`` of an entry cell's link (``[text](#a)`` or ``[text](BENCHMARKS.md#a)``)."""
    match = re.search(r"\]\((?:BENCHMARKS\.md)?#([^)\s]+)\)", entry)
    return match.group(1) if match else None


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the Markdown headings of ``text``: lower case, punctuation dropped, spaces to hyphens,
    ``-1``, ``-2`` ... for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _strip_fences(text).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def disagreements(status: list[dict[str, str]], summary: list[dict[str, str]]) -> list[str]:
    """What a summary (README) row says that the status row of the same target does not, one line per difference."""
    by_target = {row["target"]: row for row in status}
    problems = []
    for row in summary:
        ref = by_target.get(row["target"])
        if ref is None:
            problems.append(f"README target not in BENCHMARKS.md's status table: {row['target']!r}")
            continue
        for column in ("current value", "verdict", "date"):
            if row[column] != ref[column]:
                problems.append(f"{row['target']!r}: README {column} {row[column]!r}, "
                                f"BENCHMARKS.md {ref[column]!r}")
        if anchor_of(row["entry"]) != anchor_of(ref["entry"]):
            problems.append(f"{row['target']!r}: README links {anchor_of(row['entry'])!r}, "
                            f"BENCHMARKS.md {anchor_of(ref['entry'])!r}")
    return problems


STATUS = status_rows(_section(BENCHMARKS, "Status"))
SUMMARY = status_rows(_section(README, "Results"))


def test_the_status_table_is_complete():
    assert len(STATUS) >= 30, "BENCHMARKS.md's ## Status tables lost rows"
    targets = [row["target"] for row in STATUS]
    assert len(targets) == len(set(targets)), "a target appears twice in the status table"
    anchors = heading_anchors(BENCHMARKS)
    for row in STATUS:
        assert row["verdict"] in VERDICTS, row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
        assert row["current value"], row
        assert anchor_of(row["entry"]) in anchors, f"status row links to no heading: {row}"


def test_readme_summary_agrees_with_the_status_table():
    assert len(SUMMARY) >= 10, "the README's Results section has no status-table rows"
    assert disagreements(STATUS, SUMMARY) == []


def stated_date_range(text: str, rows: str = "GPU") -> tuple[str, str]:
    """The README Results intro's "GPU rows: one NVIDIA H200, <first> to <last>" (or its "CPU rows: ...")."""
    match = re.search(rf"{rows} rows: [^.]*?(\d{{4}}-\d{{2}}-\d{{2}}) to (\d{{4}}-\d{{2}}-\d{{2}})", text)
    assert match, f"the README's Results intro no longer states the {rows} rows' dates: update this test"
    return match.group(1), match.group(2)


def test_readme_rows_lie_in_the_dates_it_states():
    """The intro once said the rows ran to 12-01 above rows dated 12-02: every summary row's date is in the range
    of the GPU rows or of the CPU rows."""
    results = _section(README, "Results")
    ranges = [stated_date_range(results, rows) for rows in ("GPU", "CPU")]
    outside = sorted({row["date"] for row in SUMMARY if not any(a <= row["date"] <= b for a, b in ranges)})
    assert outside == [], f"README rows dated outside the stated ranges {ranges}"


def test_every_link_into_benchmarks_resolves():
    anchors = heading_anchors(BENCHMARKS)
    inside = re.findall(r"\]\(#([^)\s]+)\)", BENCHMARKS)
    from_readme = re.findall(r"BENCHMARKS\.md#([^)\s]+)\)", README)
    assert inside and from_readme
    assert sorted({a for a in inside + from_readme if a not in anchors}) == []


def test_readme_long_context_table_is_the_benchmarks_entry():
    """The README keeps issue 29's long-context table; each of its RULER cells is a cell of the entry's table."""
    readme = README[README.index("**Long context after POD adaptation"):]
    entry = BENCHMARKS[BENCHMARKS.index("### The control beside POD"):]
    cells = re.findall(r"\d+\.\d \(\d+%\)", readme.split("\n\n")[1])
    assert len(cells) >= 12
    assert sorted(c for c in cells if c not in entry) == []


def _readme_schemes() -> dict[str, set[str]]:
    """Scheme names the README gives for a phase: the "Prefill schemes: ... Decode schemes: ..." list and every
    ``prefill_scheme=`` / ``decode_scheme=`` / ``--prefill-scheme`` / ``--decode-scheme`` value."""
    named: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for phase in named:
        listed = re.search(rf"{phase.capitalize()} schemes: ((?:`[^`]+`,?\s*)+)", README)
        assert listed, f"the README's {phase} scheme list is gone"
        named[phase] |= set(re.findall(r"`([^`]+)`", listed.group(1)))
        named[phase] |= set(re.findall(rf"\b{phase}_scheme=[\"']?([\w+]+)", README))
        named[phase] |= set(re.findall(rf"--{phase}-scheme[ =]([\w+]+)", README))
    return named


def test_readme_names_only_registered_schemes():
    from sparse_models.schemes.registry import scheme_names

    named = _readme_schemes()
    assert {"dense", "tidal"} <= named["decode"] and {"dense", "token_sparse"} <= named["prefill"]
    for phase, names in named.items():
        assert sorted(names - set(scheme_names(phase))) == [], f"README {phase} schemes the registry lacks"


def _readme_lists() -> dict[str, set[str]]:
    """The README's "Prefill schemes: ... Decode schemes: ..." lists alone."""
    return {phase: set(re.findall(r"`([^`]+)`", re.search(rf"{phase.capitalize()} schemes: ((?:`[^`]+`,?\s*)+)",
                                                           README).group(1)))
            for phase in ("prefill", "decode")}


def test_readme_lists_every_registered_scheme():
    """The other direction: a scheme in the registry but not in the README's lists (the lists went stale once)."""
    from sparse_models.schemes.registry import scheme_names

    for phase, names in _readme_lists().items():
        assert sorted(set(scheme_names(phase)) - names) == [], f"registered {phase} schemes the README does not list"


ARCHITECTURE = (REPO / "ARCHITECTURE.md").read_text()


def architecture_lists(text: str) -> dict[str, list[str]]:
    """ARCHITECTURE.md's closed lists of what the registry holds: the config sections ("... `streaming` today") and
    the built-in roles per phase ("the built-in ones: ... in prefill; ... in decode")."""
    sections = re.search(r"schemes/<method>\.py`; ((?:`[^`]+`,?\s*)+)today\)", text)
    roles = re.search(r"the\s+built-in ones: (.+?) in prefill; (.+?) in decode\)", text, flags=re.S)
    assert sections and roles, "ARCHITECTURE.md's lists of config sections / roles moved: update this test"
    split = lambda listed: sorted(" ".join(listed.split()).split(", "))  # noqa: E731
    return {"sections": sorted(re.findall(r"`([^`]+)`", sections.group(1))),
            "prefill": split(roles.group(1)), "decode": split(roles.group(2))}


def test_architecture_lists_are_the_registry():
    from sparse_models.schemes.registry import SCHEMES, config_sections

    registry = {"sections": sorted(config_sections()),
                "prefill": sorted({role for s in SCHEMES.values() for role in s.prefill}),
                "decode": sorted({role for s in SCHEMES.values() for role in s.decode})}
    assert architecture_lists(ARCHITECTURE) == registry


# --- the checks themselves, on planted text -------------------------------------------------------------------

_PLANTED_STATUS = """\
## Status

| target | current value | verdict | date | entry |
|---|---|---|---|---|
| POD training attention ≤ 1.3× SDPA | 1.17× | met | 2026-12-02 | [e](#entry-a) |
| POD decode ≤ 1.05× full decode | 1.10–1.20× | missed | 2026-12-01 | [e](#entry-b) |

## Entry A
"""


def _planted_readme(value: str, verdict: str, target: str = "POD training attention ≤ 1.3× SDPA") -> str:
    return f"""\
## Results

| target | current value | verdict | date | entry |
|---|---|---|---|---|
| {target} | {value} | {verdict} | 2026-12-02 | [e](BENCHMARKS.md#entry-a) |

## Usage
"""


def _planted(readme: str) -> list[str]:
    return disagreements(status_rows(_section(_PLANTED_STATUS, "Status")), status_rows(_section(readme, "Results")))


def test_parser_reads_the_planted_tables():
    rows = status_rows(_section(_PLANTED_STATUS, "Status"))
    assert [r["target"] for r in rows] == ["POD training attention ≤ 1.3× SDPA", "POD decode ≤ 1.05× full decode"]
    assert anchor_of(rows[1]["entry"]) == "entry-b"
    assert _planted(_planted_readme("1.17×", "met")) == []


@pytest.mark.parametrize("value, verdict, target, what", [
    ("1.29×", "met", "POD training attention ≤ 1.3× SDPA", "current value"),
    ("1.17×", "missed", "POD training attention ≤ 1.3× SDPA", "verdict"),
    ("1.17×", "met", "POD training attention ≤ 1.25× SDPA", "not in BENCHMARKS.md"),
])
def test_a_planted_disagreement_fails(value, verdict, target, what):
    problems = _planted(_planted_readme(value, verdict, target))
    assert len(problems) == 1 and what in problems[0], problems


def test_the_architecture_list_check_reads_a_planted_text():
    text = ("of the registered schemes (each defined in its `schemes/<method>.py`; `pod`,\n  `recent` today); ...\n"
            "(the built-in ones: dense, pod-anchor in prefill; dense,\n  recent in decode).")
    assert architecture_lists(text) == {"sections": ["pod", "recent"], "prefill": ["dense", "pod-anchor"],
                                        "decode": ["dense", "recent"]}


def test_heading_anchors_follow_github():
    text = "# A — b (issue 3, 2026-12-01)\n## Decode, second pass: POD's skip\n## x\n## x\n```\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a--b-issue-3-2026-12-01", "decode-second-pass-pods-skip", "x", "x-1"}
