"""Issue 29: the SuperLink's loopback listener served Flower's Control API to any local account.

Before: ``flwr ls`` as ``nobody`` listed the coordinator's runs (and ``flwr run`` would have been
code execution as the coordinator's user, who holds every site's credentials). The same on a fog
host running a site aggregator (it runs the same ``cloud_coordinator.superlink``). Now the
loopback listener asks the kernel whose socket each connection comes from and serves only its
own user: a real ``flower-superlink`` application, a real ``flwr`` CLI as ``nobody`` (403) and as
the coordinator's user (its runs). Needs root to switch to ``nobody``; skipped otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cloud_coordinator.superlink import own_user_only, peer_uid, socket_owner
from runtime.broker import free_port

from waiting import wait_for

VENV_BIN = Path(sys.executable).parent
NOBODY = 65534


def _flwr_ls(home: Path, as_nobody: bool) -> dict[str, object]:
    pre = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if as_nobody else []
    r = subprocess.run([*pre, str(VENV_BIN / "flwr"), "ls", "local", "--format", "json"], capture_output=True,
                       text=True, env={**os.environ, "FLWR_HOME": str(home), "HOME": str(home)}, cwd=home,
                       timeout=120, check=False)
    try:
        doc = json.loads(r.stdout[r.stdout.index("{"):])
    except ValueError:
        doc = {"success": False, "error-message": (r.stdout + r.stderr)[-400:]}
    return doc if isinstance(doc, dict) else {"success": False}


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="switching to another uid (nobody) needs root and setpriv")
def test_another_local_account_cannot_use_the_control_api(tmp_path: Path) -> None:
    home = Path(tempfile.mkdtemp(prefix="flwr-home-"))
    control, fleet = free_port("127.0.0.1"), free_port("127.0.0.1")
    db = tmp_path / "superlink.db"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "cloud_coordinator.superlink",
                             "--fleet-address", f"127.0.0.1:{fleet}", "--database", str(db),
                             "--host", "127.0.0.1", "--port", str(control), "--insecure",
                             "--disable-runtime-dependency-installation"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        home.chmod(0o755)  # nobody must read its config: not under pytest's tmp root (0700)
        (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                                          f'address = "127.0.0.1:{control}"\ninsecure = true\n')
        (home / "config.toml").chmod(0o644)
        mine: dict[str, object] = {}

        def own_user_lists() -> bool:
            mine.update(_flwr_ls(home, as_nobody=False))
            return mine.get("success") is True

        wait_for(own_user_lists, 90, lambda: f"the coordinator's own flwr ls: {mine}")
        theirs = _flwr_ls(home, as_nobody=True)
        assert theirs.get("success") is not True and "403" in str(theirs.get("error-message")), theirs
        assert "runs" not in theirs
        assert db.exists() and db.stat().st_mode & 0o077 == 0  # superlink.db: its user's alone
    finally:
        shutil.rmtree(home, ignore_errors=True)
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_socket_owner_reads_the_kernel_table() -> None:
    table = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
             "   0: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 1\n"
             "   1: 0100007F:D2F0 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 2\n")
    assert socket_owner(table, ("127.0.0.1", 0xD2F0), ("127.0.0.1", 0x1F90)) == NOBODY
    assert socket_owner(table, ("127.0.0.1", 0x1F90), ("127.0.0.1", 0xD2F0)) == 0
    assert socket_owner(table, ("127.0.0.1", 1), ("127.0.0.1", 0x1F90)) is None


@pytest.mark.parametrize("owner, status", [(0, 200), (NOBODY, 403), (None, 403)])
def test_the_guard_serves_only_its_own_user(owner: int | None, status: int) -> None:
    import asyncio

    async def app(scope: object, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]

    sent: list[dict[str, object]] = []

    async def send(m: dict[str, object]) -> None:
        sent.append(m)

    guarded = own_user_only(app, 0, lambda c, s: owner)
    asyncio.run(guarded({"type": "http", "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 6)}, None, send))
    assert sent[0]["status"] == status


@pytest.mark.integration  # a real loopback connection
def test_peer_uid_names_this_process_for_its_own_connection() -> None:
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    with srv, socket.create_connection(srv.getsockname()) as c:
        conn, _ = srv.accept()
        with conn:
            assert peer_uid(c.getsockname(), srv.getsockname()) == os.getuid()
            assert peer_uid(("127.0.0.1", 1), srv.getsockname()) is None
