"""SQLite desired state: versions, quotas, assignments, epoch survive a reopen."""
from __future__ import annotations

from pathlib import Path

from fog_broker.store import Store, StoredAssignment


def test_versions_quotas_assignments_and_epoch_persist(tmp_path: Path) -> None:
    s = Store(tmp_path / "fog.db")
    assert s.next_epoch() == 1
    spec = {"name": "w", "model": "zoo:mlp", "source": "a", "sink": "a"}
    assert s.put_workload(spec, {"p": 1}, 0.0) == 1
    assert s.put_workload(spec, {"p": 1}, 1.0) == 1  # identical: same version
    assert s.put_workload({**spec, "priority": 5}, {"p": 1}, 2.0) == 2
    s.put_quotas({"t": 5e6})
    rows = [StoredAssignment("w", 2, 0, 0, 0, 3, "a", "ab" * 32)]
    s.replace_assignments("w", rows)
    s.close()

    s2 = Store(tmp_path / "fog.db")
    assert s2.next_epoch() == 2
    (w,) = s2.workloads()
    assert (w.name, w.version, w.spec["priority"], w.profile) == ("w", 2, 5, {"p": 1})
    assert s2.quotas() == {"t": 5e6}
    assert s2.assignments() == rows
    assert s2.delete_workload("w") and s2.assignments() == [] and s2.workloads() == []
    s2.close()
