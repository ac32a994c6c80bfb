"""gemray.controller.run helpers that need no running cluster."""

from __future__ import annotations

import pytest
import ray

from gemray.config import JobConfig
from gemray.controller import run


class _FakeInit:
    def __init__(self, errors):
        self.errors, self.calls, self.shutdowns = list(errors), 0, 0

    def init(self, **kw):
        self.calls += 1
        assert kw["address"] == "local"
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    def install(errors):
        fake = _FakeInit(errors)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return fake
    return install


def test_embedded_cluster_start_is_retried_once_after_a_startup_timeout(fake_ray):
    fake = fake_ray([Exception("The current node timed out during startup. This could happen ...")])
    assert run._connect_ray(JobConfig()) is True
    assert (fake.calls, fake.shutdowns) == (2, 1)


def test_other_start_errors_and_a_second_timeout_propagate(fake_ray):
    fake = fake_ray([RuntimeError("port in use")])
    with pytest.raises(RuntimeError, match="port in use"):
        run._connect_ray(JobConfig())
    assert fake.calls == 1
    timeout = "The current node timed out during startup."
    fake = fake_ray([Exception(timeout), Exception(timeout)])
    with pytest.raises(Exception, match="timed out during startup"):
        run._connect_ray(JobConfig())
    assert (fake.calls, fake.shutdowns) == (2, 1)
