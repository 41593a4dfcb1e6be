"""The nixl row of ``dsv4-sm120 doctor``: is the NIXL bootstrap hardening in force here?

Cheap on purpose: reads the switch and the installed ``nixl`` version (for ``--json``), imports no sglang.
"""

from __future__ import annotations

from importlib import metadata

from dsv4_sm120 import settings
from dsv4_sm120.doctor_rows import FAIL, OK, WARN, Row, Section


def doctor_section() -> Section:
    try:
        on = settings.load().nixl_hardening
        switch_problem = None
    except settings.SettingsError as exc:
        on, switch_problem = False, str(exc)
    try:
        nixl = metadata.version("nixl")
    except metadata.PackageNotFoundError:
        nixl = None
    rows = []
    if switch_problem:
        rows.append(Row("nixl hardening", FAIL, switch_problem))
    elif on:
        rows.append(Row("nixl hardening", OK,
                        "prefill bootstrap thread rejects bad frames, tombstones aborted rooms, fails /health when a NIXL "
                        "thread dies; an abort is acknowledged once its writes drained, the decode quarantines "
                        "pages an unacknowledged abort may still reach"))
    else:
        rows.append(Row("nixl hardening", WARN,
                        "DSV4_SM120_NIXL_HARDENING=0: the pin's bootstrap thread (one unknown frame wedges PD for 300 s) and its "
                        "abort handling (an aborted room's pages go back at the release timeout, written or not)"))
    return Section("nixl_hardening", {"nixl_hardening": on, "nixl": nixl}, rows)
