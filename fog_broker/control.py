"""Requests from people and programs: who may ask (pinned keys, role rights) and what a request does.

Every request on ``fog/CTL`` (``status`` included) and on ``fog/INFER`` is an
envelope signed by an identity the site issued (``fogline operators add``),
fresh (timestamp window, per-sender replay window) and within the signer's
role (``trust.CONTROL_RIGHTS``); keys are never read from a request. Replies
go only to the signer's own reply topic, sealed by the fog.

Fair share: ``admit`` runs on the MQTT worker before a request on
``fog/CTL/{sender}`` or ``fog/INFER/{sender}`` is decoded or queued for the owner
thread (so before its signature is checked). The budget is the topic's sender's:
the broker's ACL lets only that identity write under its own name, so a request
is charged, throttled and (if its sender keeps flooding) quarantined in the name
of the identity mosquitto authenticated, never a name inside the payload. A
payload signed by anyone else than its topic's sender is dropped and charged
to the topic's sender (``charge``). Each issued identity has its own budget per
kind (``CONTROL_SHARE``); a topic naming no issued identity (only the fog could
write one) shares one budget.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from runtime.errors import DecodeError, RemoteViolation, SecurityError
from runtime.ids import is_id
from runtime.messages import ControlReply, ControlRequest, Envelope
from runtime.security import TrustStore, Verifier
from runtime.topics import CTL, INFER, RELEASE

from .placement.model import Quota, Workload
from .placement.spec import SpecError
from .ratelimit import OVER, QUARANTINED, Budget, FairShare, LogLimit, RateLimit, SharePolicy
from .site_core import RemoveWorkload, SetQuotas, SetWorkload
from .trust import deploy_ref_allowed, may_control

if TYPE_CHECKING:
    from .port import FogPort

__all__ = ["CONTROL_SHARE", "MAX_REQUEST_BYTES", "ControlPlane", "json_default",
           "misaddressed", "refusal_id"]

MAX_REQUEST_BYTES = 24 * 1024 * 1024  # a deploy carrying an uploaded model (base64)
# Per identity: a client polling status (`wait_running`: ~10/s), the site page and a deploy script
# stay well within the control budget; an app's inference requests over MQTT within the infer one.
# Past a budget requests are dropped unchecked (throttled); an identity is quarantined only for
# requests that fail their checks (signed by someone else, replayed copies, bad signatures): 100
# within 10 s, which a flood of those reaches within a fraction of a second.
# Releases (``cloud/RELEASE/{id}``, which only that coordinator may write) come a few a day: a
# budget per coordinator, taken before a release is decoded, so a coordinator flooding it costs a
# lookup each; junk releases count as failed checks, so it is quarantined (writes withheld at the broker).
CONTROL_SHARE = SharePolicy(limits={CTL: Budget(20.0, 100.0), INFER: Budget(1000.0, 2000.0),
                                    RELEASE: Budget(5.0, 20.0)},
                            quarantine_failures=100, window_s=10.0, quarantine_s=60.0, max_identities=10_000)
_STRANGER = "?"  # the one budget of every topic id the fog did not issue

log = logging.getLogger("fog_broker.control")


def misaddressed(request: Any, kind: type[Any], own_reply_topic: str) -> str | None:
    """Why a verified request is not answered (a ``rejected:`` counter's reason), or None: it must
    be a ``kind`` and ask for its answer on its sender's own reply topic, never someone else's."""
    if not isinstance(request, kind):
        return "wrong kind"
    if request.reply_to != own_reply_topic:
        return "reply_to"
    return None


def refusal_id(env: Envelope) -> str:
    """The id a refusal of ``env`` carries: the sender can compute it from what it sent, no one else."""
    return "refused:" + hashlib.sha256(env.signature).hexdigest()[:32]


def json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


class ControlPlane:
    """Verifies and runs control requests on the service's owner thread."""

    def __init__(self, svc: FogPort) -> None:
        self.svc = svc
        self.keys = TrustStore()          # operators, coordinators, apps: name -> signing key
        self.roles: dict[str, str] = {}
        self.verifier = Verifier(self.keys, max_size=MAX_REQUEST_BYTES)
        self.counters: Counter[str] = Counter()
        self._refusals: dict[str, RateLimit] = {}  # claimed sender -> its refusal budget
        self.share: FairShare | None = FairShare(CONTROL_SHARE)  # MQTT worker thread (see admit)
        self._logs = LogLimit()  # MQTT worker: lines about refused copies, per sender
        self._owner_logs = LogLimit()  # owner thread: refusals after a signature check, per sender
        # written by the MQTT worker only; seeded so the owner thread may iterate the dict meanwhile
        self.counters.update({"limited:over budget": 0, "limited:quarantined": 0, "rejected:signer not topic": 0,
                              "rejected:replayed copy": 0})

    def set_identities(self, identities: Mapping[str, tuple[str, bytes]]) -> None:
        """Replace who may sign requests (name -> (role, key)); called when trust.db changes."""
        for name in list(self.roles):
            if name not in identities:
                self.keys.remove(name)
                self.verifier.forget(name)
                del self.roles[name]
        for name, (role, key) in identities.items():
            if self.keys.key_bytes(name) != key:
                self.keys.enroll(name, key)
                self.verifier.forget(name)
            self.roles[name] = role

    def admit(self, sender: str, kind: str, now: float) -> bool:
        """MQTT worker, before any decode: may a ``kind`` request on ``sender``'s topic be queued?
        (False: dropped and counted, no signature check.) ``sender`` is the topic's id."""
        if self.share is None:
            return True
        who = sender if sender in self.keys else _STRANGER
        verdict = self.share.admit(who, kind, now)
        if verdict in (OVER, QUARANTINED):
            self.counters[f"limited:{verdict}"] += 1
            if self._logs.allow(who, now):
                held = self._logs.suppressed(who)
                log.warning("%s: %s requests %s, dropped unchecked%s", who, kind, verdict,
                            f" ({held} more since the last line)" if held else "")
            return False
        return True

    def charge(self, sender: str, kind: str, now: float, why: str = "") -> None:
        """MQTT worker: a bad request on ``sender``'s topic (``why``: signed by someone else, a replayed
        copy; "": refused after its check), counted against ``sender`` (the identity the broker
        authenticated) as a drop; the unchecked ones are counted and logged rate-limited."""
        who = sender if sender in self.keys else _STRANGER
        if self.share is not None:
            self.share.charge(who, kind, now)
        if not why:
            return
        self.counters[f"rejected:{why}"] += 1
        if self._logs.allow(who, now):
            held = self._logs.suppressed(who)
            log.warning("%s: %s request dropped unchecked: %s%s", who, kind, why,
                        f" ({held} more since the last line)" if held else "")

    def limits(self, now: float) -> dict[str, Any]:
        """Identities quarantined (and why) and the top ones by dropped requests."""
        return self.share.view(now) if self.share is not None else {}

    def shut_out(self, now: float) -> frozenset[str]:
        return self.share.shut_out(now) - {_STRANGER} if self.share is not None else frozenset()

    def open_request(self, env: Any, action: str | None = None, sender: str | None = None) -> Any:
        """The verified request inside ``env`` (None: refused and counted); ``action`` checks a right.

        ``sender``: the id of the topic it came on (the identity the broker authenticated); a
        request signed by anyone else is refused whatever its signature."""
        if not isinstance(env, Envelope):
            self.counters["rejected:unsigned"] += 1
            self._warn(sender or "?", "unsigned request refused (sign it with credentials from "
                                      "`fogline operators add`)")
            return None
        if sender is not None and env.sender != sender:
            self.counters["rejected:signer not topic"] += 1
            self._warn(sender, f"request signed by {env.sender[:64]!r} on {sender}'s topic refused")
            return None
        if env.sender not in self.keys:
            self.svc.sync_trust()  # issued a moment ago? (cheap unless trust.db changed)
        try:
            inner = self.verifier.check(env, time.time())
        except (SecurityError, DecodeError) as exc:
            reason = getattr(exc, "reason", "malformed")
            self.counters[f"rejected:{reason}"] += 1
            self._warn(env.sender[:64], f"request from {env.sender[:64]} refused: {exc}")
            if sender is not None:
                self.svc.refused(CTL if action is None else INFER, sender)
            self._refuse(env, f"request refused: {reason}")
            return None
        if action is not None and not may_control(self.roles.get(env.sender, ""), action):
            self.counters["rejected:no right"] += 1
            self._warn(env.sender, f"{env.sender} ({self.roles.get(env.sender)}) may not {action}; refused")
            if sender is not None:
                self.svc.refused(INFER if action == "infer" else CTL, sender)
            self._refuse(env, f"{env.sender} ({self.roles.get(env.sender, 'unknown')}) may not {action}")
            return None
        return inner

    def _warn(self, who: str, text: str) -> None:
        """A WARNING about a refused request, at most about one a second per sender (owner thread)."""
        now = time.monotonic()
        if self._owner_logs.allow(who, now):
            held = self._owner_logs.suppressed(who)
            log.warning("%s%s", text, f" ({held} more from {who} since the last line)" if held else "")

    def _refuse(self, env: Envelope, why: str) -> None:
        """Tell the named sender, on its own reply topic (only it can read that), why nothing happened.

        A request whose payload we never decoded has no request id, so the refusal names the
        envelope instead (``refusal_id``): a client ends only the request it sent that way, and a
        forgery in its name ends nothing of its own. Rate-limited per claimed sender.
        """
        sender = env.sender
        if not is_id(sender):
            return
        bucket = self._refusals.get(sender)
        if bucket is None:
            if len(self._refusals) >= 10_000:
                self._refusals.clear()
            bucket = self._refusals[sender] = RateLimit(5.0, 20.0)
        if not bucket.take(time.monotonic()):
            return
        self.svc.publish_signed(self.svc.topics.reply(sender), ControlReply(refusal_id(env), False, b"", why))

    def handle(self, env: Any, at: float, sender: str | None = None) -> None:
        svc = self.svc
        inner = self.open_request(env, sender=sender)
        if inner is None:
            return
        why = misaddressed(inner, ControlRequest, svc.topics.reply(env.sender))
        if why is not None:
            self.counters[f"rejected:{why}"] += 1
            self._warn(env.sender, f"control request from {env.sender} refused: {why}")
            return
        role = self.roles.get(env.sender, "")
        try:
            if not may_control(role, inner.action):
                self.counters["rejected:no right"] += 1
                raise RemoteViolation(f"{env.sender} ({role}) may not {inner.action!r}")
            body_in = json.loads(inner.body or b"{}")
            if not isinstance(body_in, dict):
                raise RemoteViolation("a control request body must be a JSON object")
            if inner.action == "hello":
                body: Any = {"fog_id": svc.config.fog_id, "site": svc.config.site, "epoch": svc.epoch,
                             "you": env.sender, "role": role}
            elif inner.action == "status":
                body = svc.status(at, offset=int(body_in.get("offset", 0)), limit=body_in.get("limit"))
            elif inner.action == "deploy":
                body = self.deploy(body_in, at)
            elif inner.action == "delete":
                body = self.delete(body_in)
            else:
                raise RemoteViolation(f"unknown action {inner.action!r}: hello, status, deploy, delete")
            self.counters[f"ok:{inner.action}"] += 1
            reply = ControlReply(inner.request_id, True, json.dumps(body, default=json_default).encode())
        except (RemoteViolation, ValueError, KeyError, TypeError) as exc:
            self.counters["refused"] += 1
            reply = ControlReply(inner.request_id, False, b"", str(exc)[:2000])
        svc.publish_signed(inner.reply_to, reply)

    # ------------------------------------------------------------ actions

    def workload_from(self, d: Mapping[str, Any], profile: Mapping[str, Any] | None) -> Workload:
        svc = self.svc
        d = dict(d)
        model = d.get("model")
        if isinstance(model, str) and model.startswith("release:"):
            rel = svc.releases.get(model[len("release:"):])  # the book: what the bytes are
            if rel is None:
                raise RemoteViolation(f"no release of {model[8:]!r} has reached this fog broker yet")
            d["model"] = rel["model"]
            profile = None  # the stored profile may be of an older release: profile the current one
        w = Workload.from_dict(d)
        if w.model is not None and profile is None:
            profile = svc.artifacts.profile(w.model, w.input_shapes)
        if profile is not None and w.profile is None:
            from .placement.model import ChainProfile
            w = w.with_profile(ChainProfile.from_dict(dict(profile)))  # its measured segment times merged in
        return w

    def deploy(self, body: Mapping[str, Any], at: float, *, internal: bool = False) -> dict[str, Any]:
        try:
            return self._deploy(body, at, internal)
        finally:
            self.svc.collect_blobs()  # a refused deploy leaves no uploaded bytes behind

    def _deploy(self, body: Mapping[str, Any], at: float, internal: bool) -> dict[str, Any]:
        svc = self.svc
        blobs = body.get("blobs") or {}
        if not isinstance(blobs, dict):
            raise SpecError("'blobs' must map sha256 to base64 ONNX bytes")
        uploaded = set()
        for sha, b64 in blobs.items():
            try:
                data = base64.b64decode(b64, validate=True)
            except (ValueError, TypeError):
                raise SpecError(f"blob {str(sha)[:12]} is not base64") from None
            ref = svc.artifacts.store_blob(data, expect_sha=str(sha))
            uploaded.add(ref[len("file:"):])
        items = body.get("workloads")
        if items is None:
            items = [body.get("workload", body)]
        if not isinstance(items, list) or not items:
            raise SpecError("deploy needs a workload or {'workloads': [...]}")
        parsed = []
        for d in items:
            if not isinstance(d, dict):
                raise SpecError("each workload must be an object")
            model = d.get("model")
            if not isinstance(model, str):
                raise SpecError(f"workload {d.get('name')!r}: the fog broker needs 'model' (zoo:NAME, "
                                "release:NAME or an uploaded ONNX file) to build partitions")
            known = svc.artifacts.has_blob(model)
            if not internal and not deploy_ref_allowed(model, frozenset(uploaded)) and not known:
                raise SpecError(f"workload {d.get('name')!r}: model must be zoo:NAME, release:NAME or an "
                                "uploaded file (fogline deploy uploads local .onnx files)")
            w = self.workload_from(d, None)
            assert w.profile is not None
            parsed.append((d, w))
        quotas = body.get("quotas") or {}
        qs = {str(t): Quota.from_dict(q, f"quotas.{t}") for t, q in quotas.items()}
        out = []
        site = svc.snapshot()  # owner thread: the site as it is now
        models: dict[str, str | None] = {}  # a name deployed twice in one request: its first model
        for d, w in parsed:
            old = site.workload(w.name)
            had = models.get(w.name, old.model if old is not None else w.model)
            models[w.name] = w.model
            # release:NAME resolving to other bytes is a new version even when the spec text is the same
            version = svc.store.put_workload(d, w.profile.to_dict() if w.profile else None, time.time(),
                                             new_model=had != w.model)
            svc.apply(SetWorkload(w, version, str(d.get("model") or "")))
            out.append({"name": w.name, "version": version,
                        "segments": len(w.profile.segments) if w.profile else 0})
        if qs:
            svc.store.put_quotas({t: q.memory_bytes for t, q in qs.items()})
            svc.apply(SetQuotas({t: Quota(m) for t, m in svc.store.quotas().items()}))
        svc.mark_dirty()
        return {"deployed": out}

    def delete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        svc = self.svc
        name = str(body.get("name", ""))
        if svc.snapshot().workload(name) is None:
            raise RemoteViolation(f"no workload named {name!r}")
        svc.apply(RemoveWorkload(name))
        svc.store.delete_workload(name)
        svc.collect_blobs()
        return {"deleted": name}

