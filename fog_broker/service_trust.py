"""Keeping the fog's keys and the broker's ACL in step with ``trust.db`` (``service.FogService``).

Enrolled devices and identities are re-read whenever ``trust.db`` changes (an approval or a
revocation from ``fogline devices`` takes effect within ``trust_poll_s``); a sender quarantined for
flooding loses its writes in the ACL until it is let back. The rules live in the pure ``trust``
and ``ratelimit`` modules; this applies them. All but ``push_acl`` run on the owner thread.
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .ratelimit import acl_shut_out
from .site_core import DeviceRemoved

if TYPE_CHECKING:
    from .service import FogService

__all__ = ["TrustSync"]

log = logging.getLogger("fog_broker.service")


class TrustSync:
    """Devices, operators, coordinators, ACL and CRL as trust.db has them, pushed where they are used."""

    def __init__(self, svc: FogService, on_acl: Callable[[str], bool | None] | None,
                 on_crl: Callable[[bytes], bool | None] | None) -> None:
        self.svc = svc
        self.coordinators: dict[str, bytes] = {}  # pinned release signers
        self._on_acl, self._on_crl = on_acl, on_crl
        self._trust_version = -1
        self._acl = ""  # the text the broker has (push_acl, under _acl_lock)
        self._acl_lock = threading.Lock()
        self._shut: frozenset[str] = frozenset()  # senders quarantined for flooding: no writes in the ACL
        self._crl = b""
        self._last_trust_poll = -math.inf

    def tick(self, now: float) -> None:
        """The owner's timer: poll trust.db, and follow the quarantines ingest and control decided."""
        svc = self.svc
        if now - self._last_trust_poll >= svc.config.trust_poll_s:
            self.sync(now)
        shut = svc.ingest.shut_out(now) | svc.control.shut_out(now)
        if shut != self._shut:
            self._quarantine_changed(shut, now)

    def sync(self, now: float) -> None:
        """Re-read trust.db when it changed: devices, operators, coordinators, ACL and CRL."""
        svc = self.svc
        self._last_trust_poll = now
        version = svc.site.db.version()
        if version == self._trust_version:
            return
        self._trust_version = version
        devices = svc.site.db.devices()
        approved = {d.device_id: d.signing_key for d in devices if d.state == "approved"}
        for name in svc.device_keys.names():
            if approved.get(name) != svc.device_keys.key_bytes(name):
                svc.device_keys.remove(name)
                svc.ingest.forget(name)
                svc.results.forget(name)
                log.warning("device %s is no longer trusted (revoked or re-keyed): cut off", name)
                svc.counters["devices_revoked"] += 1
                svc.apply(DeviceRemoved(name, "revoked"), now)
        for name, key in approved.items():
            if svc.device_keys.key_bytes(name) is None:
                svc.device_keys.enroll(name, key)
        idents = [r for r in svc.site.db.identities() if not r.revoked]
        svc.control.set_identities({r.name: (r.role, r.signing_key) for r in idents})
        self.coordinators = {r.name: r.signing_key for r in idents if r.role == "coordinator"}
        # A change the broker did not take (its test load failed: a busy machine, no free port) is
        # tried again at the next poll: a device enrolled last must not wait for a later change.
        if not self.push_acl():
            self._trust_version = -1
        crl = svc.site.crl_pem()
        if crl != self._crl:
            if self._on_crl is None or self._on_crl(crl) is not False:
                self._crl = crl
            else:
                self._trust_version = -1

    def push_acl(self) -> bool:
        """Hand the broker the site's ACL as trust.db has it now (any thread); False if it refused.

        The text is read and installed under one lock: two enrolments finishing together must not
        install their texts out of order, or the older one takes the newer device's rights away
        (it connects, its writes are dropped, and no later sync puts them back)."""
        with self._acl_lock:
            acl = acl_shut_out(self.svc.site.acl(), self._shut)
            if acl == self._acl:
                return True
            if self._on_acl is not None and self._on_acl(acl) is False:
                return False
            self._acl = acl
            return True

    def _quarantine_changed(self, shut: frozenset[str], now: float) -> None:
        """A sender was quarantined for flooding (or let back): its writes leave (return to) the ACL."""
        svc = self.svc
        for name in sorted(shut - self._shut):
            why = svc.ingest.share.reason(name) if svc.ingest.share is not None else ""
            why = why or (svc.control.share.reason(name) if svc.control.share is not None else "")
            log.warning("%s quarantined: %s; its writes are withheld at the broker", name, why)
            svc.note_event("quarantined", name, why)
        self._shut = shut
        self._trust_version = -1  # re-push the ACL
        self.sync(now)
