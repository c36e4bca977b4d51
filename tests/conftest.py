import os
import zlib

import pytest
import torch

from cuteattn import api


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """Each test sees a fresh warn-once memory and no strict-mode variable from the environment."""
    monkeypatch.delenv("CUTEATTN_STRICT", raising=False)
    api._warned_reasons.clear()
    yield
    api._warned_reasons.clear()


@pytest.fixture
def seed(request):
    """Fresh random inputs per test, reproducible: crc32 of the test id, offset by CUTEATTN_SEED."""
    value = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("CUTEATTN_SEED", "0"))
    torch.manual_seed(value)
    return value
