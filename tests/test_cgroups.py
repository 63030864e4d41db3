"""Engine cgroups (engines/cgroups.py): the parsers over /proc text and the naming rule. The
real cgroupfs is exercised in tests/faults/test_cgroups.py."""

from __future__ import annotations

from pathlib import Path

from engines.cgroups import EngineCgroups, agent_dir_name, v2_mount, v2_path


def test_the_cgroup_v2_mount_and_path_are_read_from_proc_text() -> None:
    mountinfo = ("25 1 0:22 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                 "31 1 0:28 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    assert v2_mount(mountinfo) == "/sys/fs/cgroup/unified"
    assert v2_mount(mountinfo.splitlines()[0]) is None
    assert v2_mount("40 1 0:30 / /sys/fs/my\\040cgroup rw - cgroup2 none rw") == "/sys/fs/my cgroup"
    assert v2_path("4:memory:/x\n0::/kubepods/pod1/c1\n") == "/kubepods/pod1/c1"
    assert v2_path("0::\n") == "/" and v2_path("4:memory:/x\n") is None



def test_each_state_directory_has_its_own_cgroup_directory(tmp_path: Path) -> None:
    assert agent_dir_name("/var/lib/agent") != agent_dir_name("/var/lib/agent2")
    assert agent_dir_name("/var/lib/agent").startswith("runtime-agent.")
    cgroups = EngineCgroups(tmp_path / agent_dir_name("/var/lib/agent"))
    assert cgroups.members("e-1") == [] and cgroups.kill("e-1") is False  # no such cgroup
    assert cgroups.remove("e-1") is True and cgroups.engine_ids() == []
