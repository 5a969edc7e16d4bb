"""runtime.discovery: a fog broker advertised by one process is found by another (mDNS on 127.0.0.1)."""
from __future__ import annotations

import select
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from runtime.discovery import browse
from runtime.messages import PROTOCOL_VERSION

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

ADVERTISER = textwrap.dedent("""
    import sys
    from runtime.discovery import advertise
    ad = advertise(sys.argv[1], sys.argv[2], "127.0.0.1", int(sys.argv[3]))
    print("ready", flush=True)
    sys.stdin.readline()  # until the test closes our stdin
    ad.close()
    print("closed", flush=True)
""")


def test_advertise_in_subprocess_browse_here() -> None:
    site = f"site-{uuid.uuid4().hex[:8]}"  # unique: other tests may advertise at the same time
    fog_id = f"fog-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", ADVERTISER, site, fog_id, "18830"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready and proc.stdout.readline().strip() == b"ready", proc.stderr.read1(2000) if proc.stderr else b""
        found = browse(timeout=8.0, site=site)
        assert len(found) == 1, found
        svc = found[0]
        assert (svc.site, svc.fog_id, svc.host, svc.port, svc.protocol) == (
            site, fog_id, "127.0.0.1", 18830, PROTOCOL_VERSION)
        proc.stdin.close()  # orderly shutdown: unregister sends goodbyes
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready and proc.stdout.readline().strip() == b"closed"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)


def test_browse_for_an_absent_site_returns_nothing_in_time() -> None:
    import time

    t0 = time.monotonic()
    assert browse(timeout=1.0, site=f"nobody-{uuid.uuid4().hex[:8]}") == []
    assert time.monotonic() - t0 < 5.0
