"""Shared fixtures: a fresh pool file in /dev/shm per test, removed afterwards."""
import os
import uuid

import pytest

import cxlkv


@pytest.fixture
def pool_path():
    path = f"/dev/shm/cxlkv-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    for p in (path,):
        if os.path.exists(p):
            os.unlink(p)


@pytest.fixture
def pool(pool_path):
    cxlkv.create_pool(pool_path, 96 << 20, overwrite=True)
    p = cxlkv.Pool(pool_path, node_id=0, lease_ms=1000)
    yield p
    p.close()
