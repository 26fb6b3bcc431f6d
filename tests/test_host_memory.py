"""Host memory in a container: MemAvailable describes the node, the memory cgroup limits the process
(:mod:`clefserve.model.host_memory`). Fake cgroup trees stand in for cgroup v1 and v2 mounts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clefserve.model import device, host_memory

GIB = 1 << 30


def _v2_group(folder: Path, limit: int | str, current: int, inactive_file: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(f"{limit}\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(f"anon {current}\nfile 0\ninactive_file {inactive_file}\n")


def _v1_group(folder: Path, limit: int, usage: int, total_inactive_file: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    stat = f"cache 0\ninactive_file 7\ntotal_inactive_file {total_inactive_file}\n"  # v1: hierarchical total
    (folder / "memory.stat").write_text(stat)


def _self(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return path


def test_a_v2_pod_with_a_namespace_sees_its_limit_at_the_mount_root(tmp_path):
    root = tmp_path / "cgroup"
    _v2_group(root, 8 * GIB, 3 * GIB, inactive_file=1 * GIB)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    headroom = host_memory.cgroup_headroom(_self(tmp_path, "0::/\n"), root)
    assert headroom == 8 * GIB - (3 * GIB - 1 * GIB)


def test_the_tightest_cgroup_on_the_path_to_the_root_wins(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    _v2_group(root / "kubepods", 100 * GIB, 50 * GIB)
    _v2_group(root / "kubepods" / "pod1", 4 * GIB, 1 * GIB)
    _v2_group(root / "kubepods" / "pod1" / "ctr", "max", 1 * GIB)  # the container itself: no limit
    assert host_memory.cgroup_headroom(_self(tmp_path, "0::/kubepods/pod1/ctr\n"), root) == 3 * GIB


def test_cgroup_v1_limits_and_unlimited_groups(tmp_path):
    root = tmp_path / "cgroup"
    unlimited = 9223372036854771712
    _v1_group(root / "memory", unlimited, 3 * GIB)
    _v1_group(root / "memory" / "docker" / "abc", 2 * GIB, 1536 << 20, total_inactive_file=512 << 20)
    self_file = _self(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert host_memory.cgroup_headroom(self_file, root) == 2 * GIB - (1536 << 20) + (512 << 20)
    (root / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{unlimited}\n")
    assert host_memory.cgroup_headroom(self_file, root) is None


def test_a_container_without_a_cgroup_namespace_reads_the_mount_root(tmp_path):
    # /proc/self/cgroup names the host's path, but the container's mount shows its own cgroup at the root
    root = tmp_path / "cgroup"
    _v1_group(root / "memory", 6 * GIB, 2 * GIB)
    self_file = _self(tmp_path, "4:memory:/kubepods/burstable/pod9/ctr\n")
    assert host_memory.cgroup_headroom(self_file, root) == 4 * GIB


def test_no_cgroup_information_means_no_cap(tmp_path):
    assert host_memory.cgroup_headroom(tmp_path / "missing", tmp_path) is None
    assert host_memory.cgroup_headroom(_self(tmp_path, "0::/\n"), tmp_path / "empty") is None


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemFree:  100 kB\nMemAvailable:   24174636 kB\n")
    assert host_memory.mem_available(meminfo) == 24174636 * 1024
    meminfo.write_text("MemTotal:       24683784 kB\n")
    assert host_memory.mem_available(meminfo) is None


@pytest.mark.parametrize(("available", "headroom", "expected"), [
    (64 * GIB, 16 * GIB, 16 * GIB),  # a pod with a 16 GiB limit on a big node
    (8 * GIB, 16 * GIB, 8 * GIB),  # the node is the tighter one
    (8 * GIB, None, 8 * GIB),  # no limit
])
def test_the_cpu_pools_are_planned_within_the_tighter_of_node_and_cgroup(
        monkeypatch, available, headroom, expected):
    monkeypatch.setattr(host_memory, "mem_available", lambda: available)
    monkeypatch.setattr(host_memory, "cgroup_headroom", lambda: headroom)
    assert device.available_memory(torch.device("cpu")) == expected


def test_this_host_reports_memory():
    assert device.available_memory(torch.device("cpu")) > 0
