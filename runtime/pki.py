"""A small per-site PKI for MQTT over TLS: one CA, the broker, one certificate per client.

mosquitto is run with ``require_certificate`` and ``use_identity_as_username``,
so a client's certificate CN *is* its MQTT username and the ACL
(``runtime.broker.acl_text``) confines it by that name. Client CNs are the
device, fog and cloud ids; ``identities.json`` records which is which so
the broker can grant fog brokers and coordinators their explicit rights.
Keys are ECDSA P-256 (fast to make, supported by every TLS stack mosquitto
links against); private keys are written 0600.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import LocalViolation
from .mqtt import TlsConfig

__all__ = ["SitePki", "make_site_pki", "load_site_pki", "IDENTITIES_FILE"]

IDENTITIES_FILE = "identities.json"
_VALID_DAYS = 825


@dataclass(frozen=True, slots=True)
class SitePki:
    """Paths of a site's PKI; ``clients`` maps a client id (= CN) to (cert, key)."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    broker_cert: Path
    broker_key: Path
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    devices: tuple[str, ...] = ()
    fogs: tuple[str, ...] = ()
    clouds: tuple[str, ...] = ()

    def tls(self, client_id: str) -> TlsConfig:
        """The ``TlsConfig`` an ``MqttClient`` with this identity connects with."""
        try:
            cert, key = self.clients[client_id]
        except KeyError:
            raise LocalViolation(f"no certificate for {client_id!r} in {self.dir}") from None
        return TlsConfig(ca_file=str(self.ca_cert), cert_file=str(cert), key_file=str(key))


def _check_cn(name: str) -> None:
    if not name or any(c in name for c in "/+#\x00 ") or len(name) > 64:
        raise LocalViolation(f"invalid client id for a certificate: {name!r}")


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, pem)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
          issuer_key: ec.EllipticCurvePrivateKey | None, *, ca: bool = False,
          server_names: Iterable[str] = (), server_ips: Iterable[str] = (),
          client: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(name)
               .issuer_name(issuer or name)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    else:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=True, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False),
            critical=True)
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        assert issuer_key is not None
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_site_pki(dir: str | Path, device_ids: Iterable[str], fog_ids: Iterable[str] = ("fog-1",),
                  cloud_ids: Iterable[str] = ("cloud-1",), *,
                  broker_hosts: Iterable[str] = ("localhost",),
                  broker_ips: Iterable[str] = ("127.0.0.1",)) -> SitePki:
    """Create ``ca.pem``, ``broker.pem`` and ``{id}.pem``/``{id}.key`` per client under ``dir``."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    devices, fogs, clouds = tuple(device_ids), tuple(fog_ids), tuple(cloud_ids)
    everyone = devices + fogs + clouds
    for cn in everyone:
        _check_cn(cn)
    if len(set(everyone)) != len(everyone):
        raise LocalViolation("client ids must be unique across devices, fogs and clouds")

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("fogline-site-ca", ca_key, None, None, ca=True)
    paths = {"ca_cert": root / "ca.pem", "ca_key": root / "ca.key",
             "broker_cert": root / "broker.pem", "broker_key": root / "broker.key"}
    _write_cert(paths["ca_cert"], ca)
    _write_key(paths["ca_key"], ca_key)

    broker_key = ec.generate_private_key(ec.SECP256R1())
    hosts = tuple(broker_hosts)
    _write_cert(paths["broker_cert"], _cert(hosts[0] if hosts else "fogline-broker", broker_key, ca.subject,
                                            ca_key, server_names=hosts, server_ips=broker_ips))
    _write_key(paths["broker_key"], broker_key)

    clients: dict[str, tuple[Path, Path]] = {}
    for cn in everyone:
        key = ec.generate_private_key(ec.SECP256R1())
        cert_path, key_path = root / f"{cn}.pem", root / f"{cn}.key"
        _write_cert(cert_path, _cert(cn, key, ca.subject, ca_key, client=True))
        _write_key(key_path, key)
        clients[cn] = (cert_path, key_path)
    (root / IDENTITIES_FILE).write_text(json.dumps(
        {"devices": list(devices), "fogs": list(fogs), "clouds": list(clouds)}, indent=1))
    return SitePki(root, clients=clients, devices=devices, fogs=fogs, clouds=clouds, **paths)


def load_site_pki(dir: str | Path) -> SitePki:
    """The ``SitePki`` of a directory made by ``make_site_pki``."""
    root = Path(dir)
    try:
        ids = json.loads((root / IDENTITIES_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LocalViolation(f"{root} is not a site PKI directory: {exc}") from None
    devices, fogs, clouds = (tuple(ids.get(k, ())) for k in ("devices", "fogs", "clouds"))
    clients = {cn: (root / f"{cn}.pem", root / f"{cn}.key") for cn in devices + fogs + clouds}
    return SitePki(root, root / "ca.pem", root / "ca.key", root / "broker.pem", root / "broker.key",
                   clients, devices, fogs, clouds)
