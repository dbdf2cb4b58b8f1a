"""The default thread count follows the CPUs this process may use: the affinity mask and the cgroup CPU quota
(dspark_runtime.machine.sysinfo.usable_cpus), not os.cpu_count(). Fake cgroup trees in tmp_path; affinity and
os.cpu_count monkeypatched."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_runtime.machine import sysinfo

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def host64(monkeypatch):
    """A 64-core host whose whole affinity mask is ours (what os.cpu_count() alone would use)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _no_membership(tmp_path: Path) -> Path:
    return tmp_path / "no-proc-self-cgroup"


def test_v2_quota_rounds_up(tmp_path, host64):
    _write(tmp_path / "cg" / "cpu.max", "250000 100000\n")  # docker --cpus 2.5
    assert sysinfo.cgroup_cpu_limit(tmp_path / "cg", _no_membership(tmp_path)) == 3
    assert sysinfo.usable_cpus(tmp_path / "cg", _no_membership(tmp_path)) == 3


def test_v2_quota_below_one_cpu_gives_one(tmp_path, host64):
    _write(tmp_path / "cg" / "cpu.max", "50000 100000\n")
    assert sysinfo.usable_cpus(tmp_path / "cg", _no_membership(tmp_path)) == 1


def test_v2_max_is_unlimited(tmp_path, host64):
    _write(tmp_path / "cg" / "cpu.max", "max 100000\n")
    assert sysinfo.cgroup_cpu_limit(tmp_path / "cg", _no_membership(tmp_path)) is None
    assert sysinfo.usable_cpus(tmp_path / "cg", _no_membership(tmp_path)) == 64


def test_v2_own_cgroup_and_ancestors_tightest_wins(tmp_path, host64):
    cg = tmp_path / "cg"
    _write(cg / "cpu.max", "max 100000\n")
    _write(cg / "kubepods" / "cpu.max", "400000 100000\n")  # a parent's quota limits its children
    _write(cg / "kubepods" / "pod1" / "cpu.max", "max 100000\n")
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1\n")
    assert sysinfo.usable_cpus(cg, proc) == 4
    _write(cg / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    assert sysinfo.usable_cpus(cg, proc) == 2


def test_v1_quota(tmp_path, host64):
    cpu = tmp_path / "cg" / "cpu,cpuacct"
    _write(cpu / "cpu.cfs_quota_us", "200000\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    assert sysinfo.cgroup_cpu_limit(tmp_path / "cg", _no_membership(tmp_path)) == 2
    assert sysinfo.usable_cpus(tmp_path / "cg", _no_membership(tmp_path)) == 2


def test_v1_unlimited_and_own_cgroup(tmp_path, host64):
    cpu = tmp_path / "cg" / "cpu"
    _write(cpu / "cpu.cfs_quota_us", "-1\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "cgroup"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert sysinfo.usable_cpus(tmp_path / "cg", proc) == 64  # own cgroup not mounted: root only, unlimited
    _write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "300000\n")
    _write(cpu / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert sysinfo.usable_cpus(tmp_path / "cg", proc) == 3


def test_missing_or_malformed_files_are_no_limit(tmp_path, host64):
    assert sysinfo.cgroup_cpu_limit(tmp_path / "nothing", _no_membership(tmp_path)) is None
    assert sysinfo.usable_cpus(tmp_path / "nothing", _no_membership(tmp_path)) == 64
    _write(tmp_path / "bad" / "cpu.max", "garbage\n")
    _write(tmp_path / "bad" / "cpu" / "cpu.cfs_quota_us", "100000\n")  # period file missing
    assert sysinfo.usable_cpus(tmp_path / "bad", _no_membership(tmp_path)) == 64


def test_affinity_narrower_than_quota_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5}, raising=False)  # taskset -c 2,5
    assert sysinfo.usable_cpus(tmp_path / "none", _no_membership(tmp_path)) == 2
    _write(tmp_path / "cg" / "cpu.max", "800000 100000\n")
    assert sysinfo.usable_cpus(tmp_path / "cg", _no_membership(tmp_path)) == 2


def test_without_sched_getaffinity_uses_cpu_count(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    assert sysinfo.usable_cpus(tmp_path / "none", _no_membership(tmp_path)) == 12
    _write(tmp_path / "cg" / "cpu.max", "500000 100000\n")
    assert sysinfo.usable_cpus(tmp_path / "cg", _no_membership(tmp_path)) == 5
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert sysinfo.usable_cpus(tmp_path / "none", _no_membership(tmp_path)) == 1


def test_engine_default_threads_follow_affinity():
    """DEFAULT_THREADS in a fresh interpreter on a pretend 64-core host pinned to one CPU: 1 (the old
    min(os.cpu_count(), 8) gave 8), and 8 (the cap) with the whole mask."""
    code = ("import os, sys; os.cpu_count = lambda: 64; n = int(sys.argv[1]);"
            " os.sched_getaffinity = lambda pid: set(range(n));"
            " from dspark_runtime.engine import DEFAULT_THREADS; print(DEFAULT_THREADS)")
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no os.sched_getaffinity on this platform")

    def default_threads(n: int) -> int:
        out = subprocess.run([sys.executable, "-c", code, str(n)], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        return int(out.strip())

    assert default_threads(1) == 1
    limit = sysinfo.cgroup_cpu_limit()  # this machine's real quota, if any, applies in the child too
    assert default_threads(64) == min(8, limit or 8)
