"""Finding 15 (coordinator part): checkpoints were unsigned, a forged round in one replica won the
resume, quorum 2 silently became 1 with one directory, and temp files stayed behind on ENOSPC.

Now checkpoints are signed by default, a resume takes only a signed round whose identical
payload verifies in a quorum of replicas, a quorum larger than the replica count is an
error, and a failed write (here: the kernel refusing a file larger than RLIMIT_FSIZE, the
same path as ENOSPC) leaves neither a temp file nor a half-written checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from cloud_coordinator.policy import CheckpointPolicy
from cloud_coordinator.settings import key_path
from cloud_coordinator.store import Checkpoint, CheckpointStore
from cloud_coordinator.strategy import CHECKPOINT_KEY, CheckpointConfig, RobustStrategy, RoundConfig
from runtime.errors import LocalViolation
from runtime.security import Identity, sign_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cloud_coordinator"))
from _grid import LocalGrid, pull_client


def _run(dirs: list[Path], rounds: int) -> ArrayRecord:
    g = LocalGrid()
    for i in range(4):
        g.add(pull_client(np.float32(i), noise_seed=i))
    init = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
    return RobustStrategy("median", f=1, rounds=RoundConfig(fraction_evaluate=0.0, round_timeout=5, grace=0),
                          checkpoints=CheckpointConfig(dirs=dirs)).start(grid=g, initial_arrays=init,
                                                                         num_rounds=rounds).arrays


def _forge(d: Path, rnd: int, like: Path, key: Identity | None) -> None:
    """An attacker's checkpoint of round ``rnd`` in replica ``d``: the honest one's config, evil weights."""
    honest = Checkpoint.from_payload(like.with_suffix(".bin").read_bytes())
    evil = Checkpoint(rnd, (np.full(4, 1e6, np.float32),), honest.config_hash, honest.aggregator_state,
                      honest.rng_state, honest.history, honest.extra, honest.names)
    payload = evil.to_payload()
    manifest = {"format": 1, "round": rnd, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                "config_hash": evil.config_hash, "created": 0}
    if key is not None:
        manifest["signature"] = sign_artifact(key, payload, {"round": rnd, "config_hash": evil.config_hash}).to_dict()
    (d / f"ckpt-{rnd:08d}.bin").write_bytes(payload)
    (d / f"ckpt-{rnd:08d}.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("signer", ["unsigned", "attacker-key", "coordinator-key-one-replica"])
def test_forged_round_in_one_replica_never_wins_the_resume(tmp_path: Path, signer: str) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    _run(dirs, 2)
    assert not (dirs[0] / CHECKPOINT_KEY).exists()  # the key is not in the directory it protects
    real_key = Identity.load("coordinator", key_path(dirs[0], CHECKPOINT_KEY))
    key = {"unsigned": None, "attacker-key": Identity.generate("coordinator"),
           "coordinator-key-one-replica": real_key}[signer]
    _forge(dirs[1], 9, dirs[1] / "ckpt-00000002.json", key)  # "round 9" in replica b only
    store = CheckpointStore(dirs, identity=real_key)
    got, _ = store.load_latest()
    assert got is not None and got.server_round == 2 and np.all(np.abs(got.weights[0]) < 10)
    # the legitimate path goes on from round 2 with the honest model
    final = _run(dirs, 3)
    assert np.all(np.abs(final["w"].numpy()) < 10)


def test_quorum_larger_than_replicas_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LocalViolation, match="quorum 2 is larger than the 1 replica"):
        CheckpointStore([tmp_path / "only"], CheckpointPolicy(quorum=2))
    with pytest.raises(Exception, match="quorum 3 is larger than the 2 replica"):
        RobustStrategy("median", f=1,
                       checkpoints=CheckpointConfig(dirs=[tmp_path / "a", tmp_path / "b"],
                                                    quorum=3)).start(grid=LocalGrid(),
                                                                     initial_arrays=ArrayRecord([np.zeros(2)]))


@pytest.mark.integration
def test_failed_write_leaves_no_temp_file_and_no_half_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import resource, signal, sys
        import numpy as np
        sys.path.insert(0, {str(Path.cwd())!r})
        from cloud_coordinator.store import Checkpoint, CheckpointStore, QuorumError
        from runtime.security import Identity
        store = CheckpointStore([{str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}], identity=Identity.generate("c"))
        store.save(Checkpoint(1, (np.zeros(10),), "h"))          # small: fits
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)             # EFBIG instead of a kill, like ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            store.save(Checkpoint(2, (np.zeros(100_000),), "h"))  # 800 kB: every replica fails
        except QuorumError as exc:
            print("QUORUM", exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "QUORUM" in out.stdout and "File too large" in out.stdout, out.stdout + out.stderr
    for d in ("a", "b"):
        names = sorted(p.name for p in (tmp_path / d).iterdir())
        assert names == ["ckpt-00000001.bin", "ckpt-00000001.json"], names  # no temp file, no round 2
    got, _ = CheckpointStore([tmp_path / "a", tmp_path / "b"]).load_latest()
    assert got is not None and got.server_round == 1


def test_a_key_left_inside_the_checkpoint_dir_moves_out_and_still_verifies(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    old = Identity.generate("coordinator")
    old.save(d / CHECKPOINT_KEY)  # where an older version kept it
    path = key_path(d, CHECKPOINT_KEY)
    assert path.parent == tmp_path / "ck.keys" and path.parent.stat().st_mode & 0o777 == 0o700
    assert not (d / CHECKPOINT_KEY).exists()
    assert Identity.load("coordinator", path).public_key_bytes == old.public_key_bytes
