"""A device's enrolled credentials in its data dir: ``tls/{ca,cert,key}.pem`` and ``fog.json``.

The agent reads these on every start; ``edge_agent.enrol`` writes them.
Nothing here talks to the network.
The fog's Ed25519 key comes from ``fog.json`` (the authenticated enrolment
answer) or from the operator (``--fog-key``), never from a message.
"""
from __future__ import annotations

from pathlib import Path

from runtime.credentials import FOG_JSON, FogInfo
from runtime.errors import LocalViolation
from runtime.mqtt import TlsConfig

__all__ = ["FogInfo", "FOG_JSON", "TLS_DIR", "FOG_EPOCH_FILE", "REPLAY_FILE", "is_enrolled", "load_fog_info",
           "tls_config", "enrolled_settings", "NOT_ENROLLED"]

TLS_DIR = "tls"
# What the agent remembers about the fog it pinned (dropped when an enrolment pins another key):
FOG_EPOCH_FILE = "fog_epoch"    # highest fog epoch accepted from a sealed fog STATE
REPLAY_FILE = "replay.json"     # the command verifier's replay high-water marks
NOT_ENROLLED = ("{dir} is not enrolled with a fog: on the fog run `fogline token create --data-dir FOGDIR`, "
                "then start the agent with --token-file FILE or FOGLINE_TOKEN=TOKEN in its environment "
                "(or --fog-key HEX --insecure for a loopback test broker)")


def is_enrolled(data_dir: Path) -> bool:
    """True once enrolment completed: ``tls/cert.pem`` is the last file it puts in place."""
    return (Path(data_dir) / TLS_DIR / "cert.pem").is_file()


def load_fog_info(data_dir: Path) -> FogInfo | None:
    """The stored ``fog.json``, None when absent; LocalViolation when present but unusable."""
    try:
        return FogInfo.load(Path(data_dir) / FOG_JSON)
    except LocalViolation as exc:
        raise LocalViolation(f"{exc}; enrol again with --token-file") from None


def tls_config(data_dir: Path, server_hostname: str | None = None) -> TlsConfig:
    """The MQTT client identity enrolment stored under ``tls/``; the broker is verified under
    ``server_hostname`` (the fog id, which its certificate always names) when given."""
    tls = Path(data_dir) / TLS_DIR
    return TlsConfig(ca_file=str(tls / "ca.pem"), cert_file=str(tls / "cert.pem"), key_file=str(tls / "key.pem"),
                     server_hostname=server_hostname)


def enrolled_settings(data_dir: Path) -> tuple[bytes, TlsConfig, str]:
    """(pinned fog key, TLS identity, site) of an enrolled data dir; LocalViolation when it is not."""
    info = load_fog_info(data_dir)
    if info is None or not is_enrolled(data_dir):
        raise LocalViolation(NOT_ENROLLED.format(dir=data_dir))
    return info.public_key, tls_config(data_dir, info.fog_id), info.site
