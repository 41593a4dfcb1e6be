"""Loopback PD pairs shared by the nixl tests: one sglang import per process, few NIXL agents.

Every pair is the pin's real NIXL classes over UCX on 127.0.0.1 with DRAM CPU
tensors as KV pages (see dsv4_sm120.loopback.pair); only the model is absent.
``pd`` follows DSV4_SM120_NIXL_HARDENING, so running the suite with
``DSV4_SM120_NIXL_HARDENING=0`` runs the same tests against the pin's bootstrap
thread: those tests fail, which is the point.
"""

from __future__ import annotations

import pytest


def _build(hardened: bool, seed: int):
    from dsv4_sm120.loopback.pair import LoopbackPD

    return LoopbackPD(hardened=hardened, seed=seed)


def _hardening_in_force() -> bool:
    from dsv4_sm120 import settings

    return settings.load().nixl_hardening


@pytest.fixture(scope="package", autouse=True)
def switches_as_a_server_loads_them():
    """The process as a server has it: ``plugin.register`` handed the switches to the index-K area. Hooks another
    test module applied to the pin's NIXL classes (the PD integrity ones) stay applied for the process and
    read them, on the pairs' own threads too, so this holds for every test here."""
    from tests.index_k import pool_harness

    with pytest.MonkeyPatch.context() as mp:
        pool_harness.switches(mp)
        yield


@pytest.fixture(scope="session")
def make_pd():
    """Build loopback pairs; each is closed at the end of the session."""
    built = []

    def make(hardened: bool | None = None, seed: int = 0):
        pd = _build(_hardening_in_force() if hardened is None else hardened, seed)
        built.append(pd)
        return pd

    yield make
    for pd in built:
        pd.close()


@pytest.fixture(scope="session")
def pd(make_pd):
    """The pair the storm and tombstone tests share (hardened unless the switch says 0)."""
    return make_pd(seed=1)
