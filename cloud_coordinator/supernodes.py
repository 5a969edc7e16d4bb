"""SuperNodes the coordinator lets in: Flower's own SuperNode authentication, with our key book.

Flower 1.41 authenticates SuperNodes with EC key pairs: the SuperLink runs
with ``--enable-supernode-auth`` (TLS required) and accepts only public keys
registered through its Control API (``flwr supernode register KEY.pub
--name NAME``); every SuperNode request is signed with its private key
(``flower-supernode --auth-supernode-private-key KEY``). ``fogline
coordinator`` keeps the authorized keys in ``supernodes.json`` next to its
checkpoints (device id -> OpenSSH public key), registers them with the
SuperLink it starts, and the ServerApp maps each connected node to a device
id through the public key the SuperLink authenticated: never through what a
reply says about itself. One device id per key and one key per device id:
duplicates are refused when added, and two nodes resolving to one device id
are both refused at round time.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from runtime.errors import LocalViolation
from runtime.files import atomic_write
from runtime.ids import is_id

from .layout import DUPLICATE_DEVICE, UNKNOWN_NODE

__all__ = ["SUPERNODES_FILE", "AuthorizedNode", "KeyBook", "keygen", "key_id", "devices_of", "valid_device_id"]

SUPERNODES_FILE = "supernodes.json"


def valid_device_id(name: str) -> bool:
    return is_id(name)


def _load_public(data: bytes) -> ec.EllipticCurvePublicKey:
    """An EC public key from OpenSSH or PEM text (what ``flwr`` writes and what NodeInfo carries)."""
    try:
        key = (serialization.load_ssh_public_key(data) if data.lstrip().startswith(b"ecdsa-")
               else serialization.load_pem_public_key(data))
    except (ValueError, UnsupportedAlgorithm, TypeError):
        raise LocalViolation("not an EC public key in OpenSSH or PEM form") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise LocalViolation("SuperNode keys must be EC (NIST P-256/P-384/P-521) keys")
    return key


def key_id(data: bytes) -> str:
    """sha256 of the key's DER SubjectPublicKeyInfo: the same id whatever text form it came in."""
    der = _load_public(data).public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


@dataclass(frozen=True, slots=True)
class AuthorizedNode:
    device_id: str
    public_key: str  # OpenSSH text, as ``flwr supernode register`` reads it

    @property
    def key_id(self) -> str:
        return key_id(self.public_key.encode())


class KeyBook:
    """``supernodes.json``: the authorized SuperNode keys by device id (one owner process writes it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.nodes: dict[str, AuthorizedNode] = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                for dev, pub in dict(doc["nodes"]).items():
                    self._put(AuthorizedNode(str(dev), str(pub)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise LocalViolation(f"{self.path} is unusable ({exc})") from None

    def _put(self, node: AuthorizedNode) -> None:
        if not valid_device_id(node.device_id):
            raise LocalViolation(f"invalid device id {node.device_id!r} (letters, digits, . _ -; at most 64)")
        if node.device_id in self.nodes:
            raise LocalViolation(f"device {node.device_id!r} already has a key; remove it first")
        kid = node.key_id
        for other in self.nodes.values():
            if other.key_id == kid:
                raise LocalViolation(f"that key is already authorized for device {other.device_id!r}")
        self.nodes[node.device_id] = node

    def add(self, device_id: str, public_key: bytes) -> AuthorizedNode:
        """Authorize ``public_key`` (OpenSSH or PEM) as ``device_id``; duplicates of either are refused."""
        key = _load_public(public_key)
        ssh = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
        node = AuthorizedNode(device_id, ssh)
        self._put(node)
        self.save()
        return node

    def remove(self, device_id: str) -> None:
        if self.nodes.pop(device_id, None) is None:
            raise LocalViolation(f"device {device_id!r} is not authorized")
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps({"nodes": {d: n.public_key for d, n in sorted(self.nodes.items())}},
                                           indent=1))

    def by_key_id(self) -> dict[str, str]:
        """key id -> device id."""
        return {n.key_id: d for d, n in self.nodes.items()}


def keygen(out_dir: str | Path, name: str = "supernode") -> tuple[Path, Path]:
    """An EC P-384 key pair in OpenSSH form: ``NAME.key`` (0600) for the SuperNode, ``NAME.pub`` to authorize."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    priv, pub = out / f"{name}.key", out / f"{name}.pub"
    if priv.exists():
        raise LocalViolation(f"{priv} exists; refusing to overwrite a key")
    key = ec.generate_private_key(ec.SECP384R1())
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    finally:
        os.close(fd)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return priv, pub


def devices_of(nodes: Iterable[tuple[int, bytes]],
               authorized: Mapping[str, str] | None) -> tuple[dict[int, str], dict[int, str]]:
    """(node id -> device id, node id -> reason) for the connected nodes.

    ``authorized`` maps key ids to device ids (``KeyBook.by_key_id``); None when
    SuperNodes are not authenticated (simulation, ``--insecure``): then a node is
    known only by its Flower node id. Two nodes resolving to one device id are both
    refused: one of them is an impostor and we cannot tell which.
    """
    out: dict[int, str] = {}
    refused: dict[int, str] = {}
    for node, pub in nodes:
        if authorized is None:
            out[node] = f"node-{node}"
            continue
        try:
            dev = authorized.get(key_id(pub)) if pub else None
        except LocalViolation:
            dev = None
        if dev is None:
            refused[node] = UNKNOWN_NODE
        else:
            out[node] = dev
    seen: dict[str, list[int]] = {}
    for node, dev in out.items():
        seen.setdefault(dev, []).append(node)
    for ids in seen.values():
        if len(ids) > 1:
            for node in ids:
                refused[node] = DUPLICATE_DEVICE
                del out[node]
    return out, refused
