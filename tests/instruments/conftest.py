"""One fake OpenAI server per test module (uvicorn in a thread of the test process)."""

from __future__ import annotations

import pytest
from tests.instruments.fake_openai_server import FakeServer, serve


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    with serve(server) as url:
        server.url = url
        yield server


@pytest.fixture
def server(fake_server):
    """The module's server with default (healthy) behaviour; tests call ``server.reset(...)`` to misbehave."""
    fake_server.reset()
    yield fake_server
    fake_server.reset()
