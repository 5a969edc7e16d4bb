"""Shared fixtures: a real mosquitto on 127.0.0.1 (integration tests in every package use it)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.broker import BrokerConfig, MosquittoBroker, find_mosquitto


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A fresh mosquitto (free port, own data dir) for one test; stopped in teardown."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (Debian package 'mosquitto')")
    broker = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "mosquitto", persistence=False)).start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def mosquitto_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """One mosquitto shared by the tests of a module (use distinct device ids/sites per test)."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (Debian package 'mosquitto')")
    broker = MosquittoBroker(BrokerConfig(data_dir=tmp_path_factory.mktemp("mosquitto"),
                                          persistence=False)).start()
    try:
        yield broker
    finally:
        broker.stop()


def _dev_null_ok() -> bool:
    import stat

    try:
        return stat.S_ISCHR(Path("/dev/null").lstat().st_mode)
    except OSError:
        return False


@pytest.fixture(autouse=True, scope="module")
def _dev_null_stays_a_device(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests run as root here: a command that writes "atomically" to /dev/null replaces the device
    for every later process on the machine. Name the module that did it instead of failing elsewhere."""
    ok_before = _dev_null_ok()
    yield
    if ok_before and not _dev_null_ok():
        pytest.fail(f"{request.module.__name__} replaced /dev/null (now {Path('/dev/null').resolve()})")
