"""Shared fixtures (a real mosquitto on 127.0.0.1) and the tier check (``tier_guard``).

Tiers: an unmarked test is a unit test (no process, no socket, no sleep: checked);
``pytest.mark.integration`` starts real processes; ``pytest.mark.e2e`` (old name ``slow``) is a
whole-system giant. ``pytest.mark.serial`` keeps an integration test out of the parallel step.
``tests/run_tiers.py`` (``make test``) runs them as separate steps.
"""
from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from tier_guard import check, guard, tier_of

from runtime.broker import BrokerConfig, MosquittoBroker, find_mosquitto
from runtime.brokerproc import PORT_RANGE_ENV


def _worker_ports() -> None:
    """Each pytest-xdist worker (and what it starts) picks ports in its own slice of 20000-31999,
    below the kernel's ephemeral ports: a port picked and not yet bound is nobody else's pick, and
    never the source port of an outgoing connection (which took a fog's enrolment port, port + 1)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if PORT_RANGE_ENV in os.environ:
        return
    if not worker.startswith("gw") or not count.isdigit():  # one process: all of it (never a connection's port)
        os.environ[PORT_RANGE_ENV] = "20000-32000"
        return
    n, i = max(1, int(count)), int(worker[2:])
    size = 12000 // n
    os.environ[PORT_RANGE_ENV] = f"{20000 + i * size}-{20000 + (i + 1) * size}"


_worker_ports()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``slow`` is the old name of ``e2e``: give its tests the ``e2e`` marker before ``-m`` selects."""
    for item in items:
        if tier_of(item) == "e2e" and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)


def _guarded(item: pytest.Item, unit: bool = True) -> Generator[None, None, None]:
    if not unit or tier_of(item) != "unit":
        yield
        return
    with guard(item.nodeid) as did:
        yield
    check(item, did)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    """Only the test's own fixtures: module and session ones torn down here may be another tier's."""
    same_module = nextitem is not None and getattr(nextitem, "module", None) is getattr(
        item, "module", None)
    return (yield from _guarded(item, unit=same_module))


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
