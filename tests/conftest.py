"""Shared fixtures: a real mosquitto on 127.0.0.1 (integration tests in every package use it)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

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
