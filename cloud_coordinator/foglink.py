"""A plain MQTT link to one fog broker: summaries in, releases out (no control requests, no rollout).

``fogline coordinator`` now serves sites through ``siteservice`` (one
``sitelink`` per site, staged rollouts); this link stays for programs and
tests that only need the two topics. Thin shell over ``summaries`` and ``release``. It connects as the
coordinator's credential (client id = certificate CN = ``creds.name``, TLS),
or in plain MQTT with ``--insecure`` on a loopback address only. Verified
summaries go to files the ServerApp reads; signed releases the ServerApp
writes to its outbox are published here (QoS 1, not retained), each once:
``published.json`` remembers what the broker acknowledged.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from runtime.credentials import Credentials, FogInfo
from runtime.mqtt import Inbound, MqttClient, parse_hostport
from runtime.net import require_loopback
from runtime.topics import Topics

from .release import ReleaseError, read_release
from .summaries import MAX_SUMMARY_BYTES, SummaryInbox

__all__ = ["FogLink", "PUBLISHED_FILE"]

log = logging.getLogger(__name__)
PUBLISHED_FILE = "published.json"


class FogLink:
    """Summaries from one fog, verified then stored; releases from the outbox, published once."""

    def __init__(self, client: MqttClient, fog: FogInfo, summaries_dir: Path, releases_dir: Path) -> None:
        self.client = client
        self.fog = fog
        self.topics = Topics(fog.site)
        self.summaries_dir = summaries_dir
        self.releases_dir = releases_dir
        self.inbox = SummaryInbox(fog, summaries_dir)
        self.published: dict[str, dict[str, Any]] = self._load_published()

    @classmethod
    def connect(cls, broker: str, creds: Credentials, work_dir: Path, *, insecure: bool = False) -> FogLink:
        """A link for ``creds`` (TLS unless ``insecure``, which only a loopback broker gets)."""
        host, port = parse_hostport(broker)
        if insecure:
            require_loopback(host)
        client = MqttClient(creds.name, host, port, tls=None if insecure else creds.tls_for(None))
        return cls(client, creds.fog, work_dir / "summaries", work_dir / "releases")

    def _load_published(self) -> dict[str, dict[str, Any]]:
        try:
            return dict(json.loads((self.releases_dir / PUBLISHED_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return {}

    @property
    def accepted(self) -> int:
        return self.inbox.accepted

    @property
    def refused(self) -> Counter[str]:
        return self.inbox.refused

    def _on_summary(self, inbound: Inbound) -> None:  # the MQTT adapter's worker thread
        self.inbox.on_summary(inbound)

    def start(self, wait_s: float = 15.0) -> None:
        self.summaries_dir.mkdir(parents=True, exist_ok=True)
        self.client.subscribe(self.topics.summary(), self._on_summary, max_bytes=MAX_SUMMARY_BYTES)
        self.client.start(wait_s=wait_s)

    def publish_pending(self, timeout_s: float = 10.0) -> list[str]:
        """Publish every release in the outbox the broker has not acknowledged yet; their file names."""
        done: list[str] = []
        if not self.releases_dir.is_dir():
            return done
        for path in sorted(self.releases_dir.glob("*.release")):
            if path.name in self.published:
                continue
            try:
                rel = read_release(path)
                frame = path.read_bytes()
            except (ReleaseError, OSError) as exc:
                log.error("not publishing %s: %s", path.name, exc)
                self.published[path.name] = {"error": str(exc)}
                continue
            topic = self.topics.release(self.client.client_id)  # under our own name (the ACL's)
            if not self.client.publish(topic, frame, qos=1, retain=False).wait(timeout_s):
                log.warning("release %s v%d not acknowledged by %s:%d; will retry", rel.workload, rel.version,
                            self.client.host, self.client.port)
                break
            self.published[path.name] = {"workload": rel.workload, "version": rel.version,
                                         "sha256": rel.sha256}
            self._save_published()
            done.append(path.name)
            log.info("published release %s v%d (%s)", rel.workload, rel.version, rel.sha256[:12])
        return done

    def _save_published(self) -> None:
        path = self.releases_dir / PUBLISHED_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.published, indent=1, sort_keys=True))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def stop(self) -> None:
        self.client.stop()
