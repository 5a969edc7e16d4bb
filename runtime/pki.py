"""A site's PKI: one CA per fog, the broker's server certificate, one client certificate per identity.

mosquitto runs with ``require_certificate``, ``use_identity_as_username`` and
``use_username_as_clientid``: a client's certificate CN *is* its MQTT username
and its client id, and the ACL (``runtime.broker.acl_for``) confines it by that
name. The role (device, fog, operator, coordinator, app) is the certificate's
OU, so a certificate says both who and what its holder is.

Layout of a CA directory (``FOGDIR/pki``)::

    ca.pem, ca.key (0600)   the site CA; the key never leaves this directory
    issued.json             serial -> {cn, role, issued_at}: what was ever signed
    revoked.json            serial -> {cn, reason, revoked_at}: the CRL's source

Keys are ECDSA P-256 (fast to make, spoken by every TLS stack mosquitto links
against); private keys are written 0600 through a temp file and a rename.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import LocalViolation
from .files import atomic_write
from .ids import id_problem, is_id
from .mqtt import TlsConfig

__all__ = ["SiteCA", "TlsBundle", "cert_identity", "fingerprint_of", "make_key_and_csr", "write_private"]

_CA_DAYS = 3650
_LEAF_DAYS = 825          # the longest lifetime browsers accepted for a leaf; rotation is by re-enrolment
_RENEW_BEFORE_DAYS = 30   # a server certificate this close to expiry is reissued at start


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data, mode=0o600, sync_dir=True)


def _write_public(path: Path, data: bytes) -> None:
    atomic_write(path, data, sync_dir=True)  # the CRL among them: a crash never leaves an old one


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def fingerprint_of(cert_pem: bytes) -> str:
    """SHA-256 (hex) of a certificate's DER: what a bootstrap token carries for the site CA."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def cert_identity(cert_pem: bytes) -> tuple[str, str, int]:
    """(CN, role (OU), serial) of a certificate."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return (str(cn[0].value) if cn else "", str(ou[0].value) if ou else "", cert.serial_number)


def make_key_and_csr(cn: str) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a CSR for ``cn``: (key PEM, CSR PEM). The CA sets the role."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
           .sign(key, hashes.SHA256()))
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True, slots=True)
class TlsBundle:
    """A directory holding ``ca.pem``, ``cert.pem`` and ``key.pem``: one client's TLS identity."""

    dir: Path

    @property
    def ca_file(self) -> str:
        return str(self.dir / "ca.pem")

    @property
    def cert_file(self) -> str:
        return str(self.dir / "cert.pem")

    @property
    def key_file(self) -> str:
        return str(self.dir / "key.pem")

    def tls(self, server_hostname: str | None = None) -> TlsConfig:
        return TlsConfig(self.ca_file, self.cert_file, self.key_file, server_hostname)

    @classmethod
    def load(cls, directory: str | Path) -> TlsBundle:
        d = Path(directory)
        for f in ("ca.pem", "cert.pem", "key.pem"):
            if not (d / f).is_file():
                raise LocalViolation(f"{d} holds no TLS identity (missing {f})")
        return cls(d)


def _check_cn(name: str) -> None:
    """A client certificate's CN is its MQTT username, client id and ACL name: the id grammar."""
    problem = id_problem(name, "certificate name")
    if problem:
        raise LocalViolation(problem)


class SiteCA:
    """The site CA in ``dir``; ``load_or_create`` makes it on first use."""

    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.dir = directory
        self._key = key
        self.cert = cert
        self.ca_pem = _pem(cert)
        self.fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()

    @classmethod
    def load_or_create(cls, directory: str | Path, site: str) -> SiteCA:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        key_path, cert_path = d / "ca.key", d / "ca.pem"
        if key_path.exists() and cert_path.exists():
            mode = key_path.stat().st_mode & 0o777
            if mode & 0o077:
                raise LocalViolation(f"{key_path} is readable by others (mode {mode:o}); chmod 600 it")
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise LocalViolation(f"{key_path} is not an EC key")
            return cls(d, key, x509.load_pem_x509_certificate(cert_path.read_bytes()))
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fogline site CA {site}"[:64]),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fogline")])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        write_private(key_path, _key_pem(key))
        _write_public(cert_path, _pem(cert))
        ca = cls(d, key, cert)
        ca.write_crl(d / "crl.pem")
        return ca

    # ------------------------------------------------------------ issuing

    def _leaf(self, cn: str, role: str, public_key: ec.EllipticCurvePublicKey, *, server: bool = False,
              hosts: Iterable[str] = (), ips: Iterable[str] = (), valid_s: float = 0.0) -> x509.Certificate:
        _check_cn(cn)
        now = _now()
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if role:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name(attrs)).issuer_name(self.cert.subject).public_key(public_key)
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + (datetime.timedelta(seconds=valid_s) if valid_s
                                     else datetime.timedelta(days=_LEAF_DAYS)))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(
                 digital_signature=True, content_commitment=False, key_encipherment=False,
                 data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                 encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]),
                 critical=False)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                            critical=False))
        sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        if not server and not valid_s:  # a closer (``closer_bundle``) is used once and expires
            self._record(cert.serial_number, cn, role)
        return cert

    def _record(self, serial: int, cn: str, role: str) -> None:
        path = self.dir / "issued.json"
        issued = _read_json(path)
        issued[str(serial)] = {"cn": cn, "role": role, "issued_at": _now().isoformat(timespec="seconds")}
        _write_public(path, json.dumps(issued, indent=1).encode())

    def issue_bundle(self, target: str | Path, cn: str, role: str) -> TlsBundle:
        """Make a key and certificate for ``cn`` in ``target`` (ca.pem, cert.pem, key.pem 0600)."""
        d = Path(target)
        d.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._leaf(cn, role, key.public_key())
        write_private(d / "key.pem", _key_pem(key))
        _write_public(d / "cert.pem", _pem(cert))
        _write_public(d / "ca.pem", self.ca_pem)
        return TlsBundle(d)

    def closer_bundle(self, target: str | Path, cn: str, valid_s: float = 300.0) -> TlsBundle:
        """A certificate under ``cn`` that lives ``valid_s`` seconds (not recorded as issued): the broker
        uses it once to take over and close a revoked identity's live session (``close_sessions``)."""
        d = Path(target)
        d.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._leaf(cn, "closer", key.public_key(), valid_s=valid_s)
        write_private(d / "key.pem", _key_pem(key))
        _write_public(d / "cert.pem", _pem(cert))
        _write_public(d / "ca.pem", self.ca_pem)
        return TlsBundle(d)

    def issue_from_csr(self, csr_pem: bytes, cn: str, role: str) -> tuple[bytes, int]:
        """Sign a CSR whose subject CN is ``cn`` with ``role``: (certificate PEM, serial)."""
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise LocalViolation(f"bad CSR: {exc}") from None
        if not csr.is_signature_valid:
            raise LocalViolation("bad CSR: its self-signature does not verify")
        got = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not got or got[0].value != cn:
            raise LocalViolation(f"the CSR names {got[0].value if got else None!r}, not {cn!r}")
        pub = csr.public_key()
        if not isinstance(pub, ec.EllipticCurvePublicKey):
            raise LocalViolation("the CSR's key must be ECDSA (P-256)")
        cert = self._leaf(cn, role, pub)
        return _pem(cert), cert.serial_number

    def ensure_server_cert(self, out: str | Path, hosts: Iterable[str], ips: Iterable[str]) -> None:
        """``broker.pem``/``broker.key`` in ``out`` naming these hosts and IPs (reissued when they change)."""
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        hosts, ips = sorted(set(hosts)), sorted(set(ips))
        cert_path, key_path = d / "broker.pem", d / "broker.key"
        if cert_path.exists() and key_path.exists():
            try:
                cur = x509.load_pem_x509_certificate(cert_path.read_bytes())
                san = cur.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                same = (sorted(san.get_values_for_type(x509.DNSName)) == hosts
                        and sorted(str(a) for a in san.get_values_for_type(x509.IPAddress)) == ips)
                fresh = cur.not_valid_after_utc - _now() > datetime.timedelta(days=_RENEW_BEFORE_DAYS)
                if same and fresh and cur.issuer == self.cert.subject:
                    return
            except (ValueError, x509.ExtensionNotFound):
                pass
        key = ec.generate_private_key(ec.SECP256R1())
        cn = next((h for h in hosts if is_id(h)), "fogline-broker")  # SANs may be names of no id grammar
        cert = self._leaf(cn, "broker", key.public_key(), server=True,
                          hosts=hosts, ips=ips)
        write_private(key_path, _key_pem(key))
        _write_public(cert_path, _pem(cert))

    # ------------------------------------------------------------ revocation

    def revoke(self, serial: int, cn: str, reason: str) -> None:
        path = self.dir / "revoked.json"
        revoked = _read_json(path)
        revoked[str(serial)] = {"cn": cn, "reason": reason, "revoked_at": _now().isoformat(timespec="seconds")}
        _write_public(path, json.dumps(revoked, indent=1).encode())
        self.write_crl(self.dir / "crl.pem")

    def revoked_serials(self) -> set[int]:
        return {int(s) for s in _read_json(self.dir / "revoked.json")}

    def write_crl(self, path: str | Path) -> None:
        """The certificate revocation list mosquitto checks client certificates against."""
        now = _now()
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
             .last_update(now - datetime.timedelta(minutes=5)).next_update(now + datetime.timedelta(days=_CA_DAYS)))
        for serial in sorted(self.revoked_serials()):
            b = b.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
        crl = b.sign(self._key, hashes.SHA256())
        _write_public(Path(path), crl.public_bytes(serialization.Encoding.PEM))


def _read_json(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise LocalViolation(f"{path} is unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise LocalViolation(f"{path} is not a JSON object")
    return data
