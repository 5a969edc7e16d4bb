"""The edge agent on an arm64 userland: Debian bookworm (Raspberry Pi OS's base) under qemu-user.

Builds (once, cached under ``$FOGLINE_ARM64_CACHE``, default /var/cache/fogline-arm64) a
bookworm arm64 root file system with mmdebstrap and a venv in it; installs the agent from
this checkout's own wheel plus PyPI's aarch64 wheels (downloaded on the host, installed offline
inside); enrols it with a token against a real secure fog on 127.0.0.1 (LocalSite); deploys a
zoo model on it and checks its answers against x86 onnxruntime. The agent reads its board
from a recorded Raspberry Pi 5 tree (FOGLINE_PROBE_ROOT), with a ``vcgencmd`` that answers from
the recorded outputs, so the PMIC rails give it measured joules per inference.

Needs root (chroot, mounts, binfmt_misc), ``mmdebstrap`` and ``qemu-user-static``
(``apt-get install mmdebstrap qemu-user-static``), PyPI and Debian's mirror. Slow: run it with
``FOGLINE_ARM64=1`` (``make test-arm64``). Figures (wall time, idle memory) go to
``$FOGLINE_ARM64_CACHE/last-run.json`` and the test's output.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "edge_agent" / "fixtures"
CACHE = Path(os.environ.get("FOGLINE_ARM64_CACHE", "/var/cache/fogline-arm64"))
MIRROR = os.environ.get("FOGLINE_ARM64_MIRROR", "http://deb.debian.org/debian")
PACKAGES = "python3,python3-venv,ca-certificates,procps"
VENV = "/opt/fogline/venv"
BOARD = "/opt/fogline-board/pi5"  # the recorded Pi 5 tree, inside the rootfs
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")

if os.environ.get("FOGLINE_ARM64") != "1":
    pytest.skip("the arm64 agent test runs with FOGLINE_ARM64=1 (make test-arm64)", allow_module_level=True)


def _need() -> str | None:
    if os.geteuid() != 0:
        return "needs root (chroot, mounts, binfmt_misc)"
    for tool in ("mmdebstrap", "qemu-aarch64-static", "chroot", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} missing (apt-get install mmdebstrap qemu-user-static)"
    if find_mosquitto() is None:
        return "mosquitto missing"
    return None


def _run(argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                       stdin=subprocess.DEVNULL, **kw)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:6])} ... failed ({r.returncode}): {(r.stderr or r.stdout)[-1500:]}")
    return r


def _binfmt() -> None:
    """qemu-aarch64 registered with the F flag (the interpreter is opened now, so it works in a chroot)."""
    if not (BINFMT / "register").exists():
        _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], 30)
    if not (BINFMT / "qemu-aarch64").exists():
        (BINFMT / "register").write_text(QEMU_CONF.read_text().strip())
    assert "enabled" in (BINFMT / "qemu-aarch64").read_text()


def _rootfs(times: dict[str, float]) -> Path:
    rootfs = CACHE / "rootfs"
    if (rootfs / "usr/bin/python3").exists():
        return rootfs
    t0 = time.monotonic()
    tmp = CACHE / "rootfs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    _run(["mmdebstrap", "--arch=arm64", "--variant=minbase", f"--include={PACKAGES}", "--mode=root",
          "bookworm", str(tmp), MIRROR], 3000)
    tmp.rename(rootfs)
    times["rootfs_build_s"] = round(time.monotonic() - t0, 1)
    return rootfs


def _wheel(out: Path) -> Path:
    """This checkout's wheel, built from a copy (the build leaves nothing in the work tree)."""
    src = out / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("runtime", "edge_agent", "fog_broker", "cloud_coordinator", "models", "simulations"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
          str(src)], 600)
    (wheel,) = out.glob("fogline-*.whl")
    return wheel


def _install(rootfs: Path, wheel: Path, times: dict[str, float]) -> None:
    """PyPI's aarch64 wheels for the agent (downloaded on the host, once), installed offline inside."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    plats = [a for p in ("manylinux2014_aarch64", "manylinux_2_28_aarch64", "manylinux_2_27_aarch64",
                         "manylinux_2_26_aarch64") for a in ("--platform", p)]
    py = _run(["chroot", str(rootfs), "python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
              300).stdout.strip()
    _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), "--only-binary=:all:", *plats,
          "--python-version", py, str(wheel)], 900)
    inside = rootfs / "opt/fogline-wheels"
    shutil.rmtree(inside, ignore_errors=True)
    shutil.copytree(wheels, inside, ignore=shutil.ignore_patterns("fogline-*"))
    shutil.copy2(wheel, inside / wheel.name)
    if not (rootfs / VENV.lstrip("/") / "bin/python").exists():
        _run(["chroot", str(rootfs), "python3", "-m", "venv", VENV], 900)
    _run(["chroot", str(rootfs), f"{VENV}/bin/pip", "install", "-q", "--no-index", "--find-links",
          "/opt/fogline-wheels", "--force-reinstall", "--no-deps", f"/opt/fogline-wheels/{wheel.name}"], 1800)
    _run(["chroot", str(rootfs), f"{VENV}/bin/pip", "install", "-q", "--no-index", "--find-links",
          "/opt/fogline-wheels", f"/opt/fogline-wheels/{wheel.name}"], 1800)
    times["install_s"] = round(time.monotonic() - t0, 1)


def _board(rootfs: Path) -> None:
    """The recorded Pi 5 tree, and a vcgencmd that answers from its recorded outputs."""
    board = rootfs / BOARD.lstrip("/")
    shutil.rmtree(board, ignore_errors=True)
    shutil.copytree(FIXTURES / "pi5", board)
    vc = rootfs / "usr/local/bin/vcgencmd"
    vc.write_text(f'#!/bin/sh\nf="{BOARD}/vcgencmd_$1.txt"\n[ -f "$f" ] && exec cat "$f"\n'
                  'echo "error=2 error_msg=\\"Command not registered\\""\nexit 255\n')
    vc.chmod(0o755)


@contextlib.contextmanager
def _mounted(rootfs: Path) -> Iterator[None]:
    done: list[Path] = []
    try:
        for what, where, args in (("proc", "proc", ["-t", "proc"]), ("/dev", "dev", ["--bind"])):
            target = rootfs / where
            if not os.path.ismount(target):
                _run(["mount", *args, what, str(target)], 30)
                done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _reference(model: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from models import zoo
    s = ort.InferenceSession(zoo.build(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_agent_on_arm64(tmp_path: Path) -> None:
    why = _need()
    if why:
        pytest.skip(why)
    t_start = time.monotonic()
    times: dict[str, float] = {}
    _binfmt()
    rootfs = _rootfs(times)
    _install(rootfs, _wheel(tmp_path / "wheel"), times)
    _board(rootfs)
    data = rootfs / "var/lib/fogline/agent"
    shutil.rmtree(data, ignore_errors=True)
    fog = LocalSite(tmp_path / "fog", site="arm", log=tmp_path / "fog.log",
                    args=["--state-interval", "2", "--startup-wait", "2"]).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with _mounted(rootfs):
            machine = _run(["chroot", str(rootfs), "uname", "-m"], 60).stdout.strip()
            assert machine == "aarch64"
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                   "FOGLINE_PROBE_ROOT": BOARD, "FOGLINE_METERED": "no"}
            argv = [shutil.which("chroot") or "/usr/sbin/chroot", str(rootfs), f"{VENV}/bin/python", "-m",
                    "edge_agent", "--broker", fog.mqtt, "--id", "pi5-arm64", "--data-dir",
                    "/var/lib/fogline/agent", "--enroll", fog.enroll, "--token", fog.token(),
                    "--state-interval", "2", "--threads", "1"]
            t_enrol = time.monotonic()
            with open(tmp_path / "agent.log", "ab") as log:
                agent = subprocess.Popen(argv, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
            procs.append(agent)
            c = fog.client()

            def alive() -> dict[str, Any] | None:
                if agent.poll() is not None:
                    raise AssertionError(f"agent exited {agent.returncode}: "
                                         f"{(tmp_path / 'agent.log').read_text()[-2000:]}")
                return next((d for d in c.status()["devices"] if d["id"] == "pi5-arm64" and d["alive"]), None)

            dev = wait_for(alive, 600, "the arm64 agent enrolled and alive")
            times["enrol_to_alive_s"] = round(time.monotonic() - t_enrol, 1)
            assert dev["labels"]["arch"] == "arm64" and dev["labels"]["device-model"] == "pi5", dev
            status_file = data / "status.json"
            wait_for(lambda: status_file.exists() and json.loads(status_file.read_text())["phase"] == "online",
                     120, "agent online")
            idle_kb = _rss_kb(agent.pid)  # chroot execs the agent: this pid is the emulated python
            c.deploy({"workloads": [{"name": "mlp", "model": "zoo:mlp", "source": "pi5-arm64",
                                     "sink": "pi5-arm64"}]})
            t_deploy = time.monotonic()
            w = c.wait_running("mlp", 600)
            times["deploy_to_running_s"] = round(time.monotonic() - t_deploy, 1)
            assert {p["device"] for r in w["placement"] for p in r["partitions"]} == {"pi5-arm64"}
            x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
            t_inf = time.monotonic()
            out = c.infer("mlp", {"x": x}, timeout=120)
            times["first_inference_s"] = round(time.monotonic() - t_inf, 2)
            ref = _reference("mlp", x)
            (name,) = out
            np.testing.assert_allclose(out[name], ref, rtol=1e-5, atol=1e-6)  # MLAS on NEON vs AVX
            for seed in range(1, 4):
                xs = np.random.default_rng(seed).random((1, 64), dtype=np.float32)
                np.testing.assert_allclose(c.infer("mlp", {"x": xs}, timeout=60)[name], _reference("mlp", xs),
                                           rtol=1e-5, atol=1e-6)
            parts = wait_for(lambda: json.loads(status_file.read_text())["partitions"] or None, 60,
                             "partitions in the agent's status")
            # the recorded Pi 5 PMIC rails measured the partition's energy
            assert all(p["energy_measured"] and p["joules_per_inference"] > 0 for p in parts), parts
            serving_kb = _rss_kb(agent.pid)
            figures = {"date": time.strftime("%Y-%m-%d"), "wall_s": round(time.monotonic() - t_start, 1),
                       **times, "idle_rss_mib_emulated": round(idle_kb / 1024, 1),
                       "serving_rss_mib_emulated": round(serving_kb / 1024, 1),
                       "joules_per_inference": [p["joules_per_inference"] for p in parts],
                       "python": _run(["chroot", str(rootfs), f"{VENV}/bin/python", "-V"], 120).stdout.strip()}
            (CACHE / "last-run.json").write_text(json.dumps(figures, indent=1))
            print("arm64 agent:", json.dumps(figures))
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, 9)
                p.wait(30)
        fog.stop()
