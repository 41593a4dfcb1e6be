"""docs/operating.md holds the switch and metric tables that ``tools.docs_tables`` makes from the package.

Why: the operator's page lists every ``DSV4_SM120_*`` switch (from ``settings.SWITCHES``) and every
``sglang:dsv4_*`` series (from ``metrics.SPECS``). A switch or collector added, renamed or reworded without
``python -m tools.docs_tables`` must fail here, not leave the page describing another package.
"""

from __future__ import annotations

from dsv4_sm120 import metrics, settings
from tools import docs_tables


def test_the_committed_page_is_what_the_generator_writes():
    text = docs_tables.PAGE.read_text()
    assert docs_tables.stale_tables(text) == [], "docs/operating.md is stale: python -m tools.docs_tables"
    assert text == docs_tables.render(text), "docs/operating.md is stale: python -m tools.docs_tables"


def test_the_tables_name_every_switch_and_every_metric():
    text = docs_tables.PAGE.read_text()
    for switch in settings.SWITCHES:
        assert f"| `{switch.env}` | `{switch.default}` |" in text, f"{switch.env} is missing from docs/operating.md"
    for name in metrics.exposed_names():
        assert f"| `{name}` |" in text, f"{name} is missing from docs/operating.md"


def test_a_long_description_is_cut_to_the_word_limit():
    long = "one two three; " + " ".join(["word"] * 40)
    assert docs_tables.short(long, 10) == "one two three;"
    assert docs_tables.short(" ".join(["w"] * 40), 5) == "w w w w w …"
    assert docs_tables.short("short text", 5) == "short text"
