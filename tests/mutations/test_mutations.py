"""Every fix and every switch-governed branch is pinned by a mutation that its tests catch.

The catalog (``mutation_catalog.py``) names each mutation, its edit of ``src/dsv4_sm120`` and the
tests that must fail under it. Each mutation runs in its own copy of the working tree (never the
checkout) through the fork server of ``mutation_engine``; only its listed tests run. The table is
printed at the end of the report. ``python -m tests.mutations`` runs the same outside pytest.
"""

from __future__ import annotations

import pytest

from tests.mutations import mutation_engine as engine
from tests.mutations.mutation_catalog import MUTATIONS

pytestmark = [pytest.mark.mutations, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def runner():
    """The fork server over a snapshot of the tree. No unmutated baseline run here: the default suite
    runs every listed test unmutated in this same session (``python -m tests.mutations`` runs one)."""
    r = engine.Runner()
    try:
        yield r
    finally:
        r.close()


def test_every_mutation_applies_and_lists_tests_it_may_run():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)), "mutation names must be unique"
    for m in MUTATIONS:
        engine.check_applies(m)
        assert m.tests, m.name
        for test in m.tests:
            assert "::" in test and test.startswith("tests/"), f"{m.name}: {test} is not a single test"
            assert m.e2e_only or not test.startswith("tests/e2e/"), f"{m.name}: tests/e2e only for e2e_only"


def test_every_switch_has_a_mutation():
    from dsv4_sm120 import settings

    covered = " ".join(m.covers for m in MUTATIONS)
    assert [s.env for s in settings.SWITCHES if s.env not in covered] == []


@pytest.mark.parametrize(
    "mutation",
    [pytest.param(m, id=m.name, marks=[pytest.mark.e2e] if m.e2e_only else []) for m in MUTATIONS],
)
def test_mutation_is_caught(runner, mutation):
    row = runner.mutate(mutation)
    engine.ROWS.append(row)
    assert row.result == "caught", f"{mutation.name} ({mutation.covers}): {row.result}: {row.detail}"
