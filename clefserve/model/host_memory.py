"""The host memory this process may still take: MemAvailable, capped by its memory cgroups' limits.

In a container (a Kubernetes pod with ``resources.limits.memory``) /proc/meminfo describes the whole node,
so sizing pools by MemAvailable alone would plan past the pod's limit and get it OOM-killed. Every memory
cgroup from the process's own up to the root of the mounted hierarchy is read (cgroup v2, or v1's memory
controller), and the tightest headroom wins: limit less usage, with inactive file pages counted as
reclaimable, as the kubelet counts a pod's working set.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable in bytes, or None where /proc/meminfo does not say."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(folder: Path, *names: str) -> int:
    """The first of ``names`` found in the folder's memory.stat (0 if none)."""
    values = dict(line.partition(" ")[::2] for line in (_read(folder / "memory.stat") or "").splitlines())
    for name in names:
        if name in values:
            return int(values[name])
    return 0


def _headroom(folder: Path, version: int) -> int | None:
    """What the cgroup in ``folder`` allows beyond its working set; None without a limit."""
    if version == 2:
        limit, usage = _read(folder / "memory.max"), _read(folder / "memory.current")
        if limit is None or usage is None or limit == "max":
            return None
        inactive = _stat(folder, "inactive_file")
    else:
        limit, usage = _read(folder / "memory.limit_in_bytes"), _read(folder / "memory.usage_in_bytes")
        if limit is None or usage is None or int(limit) >= UNLIMITED_V1:
            return None
        inactive = _stat(folder, "total_inactive_file", "inactive_file")
    return max(0, int(limit) - (int(usage) - inactive))


def _hierarchies(self_cgroup: Path, root: Path) -> list[tuple[Path, Path, int]]:
    """(mount, the process's cgroup path inside it, version) for each memory hierarchy the process is in."""
    found = []
    for line in (_read(self_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        relative = Path(path.lstrip("/"))
        if "memory" in controllers.split(","):
            found.append((root / "memory", relative, 1))
        elif hierarchy == "0" and controllers == "" and (root / "cgroup.controllers").is_file():
            found.append((root, relative, 2))  # a pure v2 mount (a hybrid host's v2 tree has no memory)
    return found


def cgroup_headroom(self_cgroup: Path = SELF_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The tightest headroom of the process's memory cgroups, or None where none limits it."""
    tightest = None
    for mount, relative, version in _hierarchies(self_cgroup, root):
        folders = [mount / relative, *(mount / parent for parent in relative.parents)]
        if not folders[0].is_dir():
            # without a cgroup namespace the process's path may not exist in this mount (a container sees
            # its own cgroup as the mount's root): then the mount's root is its cgroup
            folders = [mount]
        for folder in folders:
            room = _headroom(folder, version)
            if room is not None and (tightest is None or room < tightest):
                tightest = room
    return tightest


def host_available() -> int | None:
    """Bytes the process may still take on this host: MemAvailable capped by its cgroups' headroom."""
    available, headroom = mem_available(), cgroup_headroom()
    if available is None:
        return headroom
    return available if headroom is None else min(available, headroom)
