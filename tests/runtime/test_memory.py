"""The memory readers behind ``auto`` budgets, against cgroup files written in a
temporary directory (NOTE [ Container limits ] in ``tensorstore_hooks/runtime/_memory.py``)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from tensorstore_hooks.runtime._memory import (
    SystemMemory,
    cgroup_memory,
    memory_cgroup_dir,
    peak_rss_bytes,
    process_memory,
)

GiB = 1 << 30
MiB = 1 << 20
V1_NO_LIMIT = "9223372036854771712"  # what the kernel writes for "no limit"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc(tmp_path: Path, cgroup: str, *, rss_kb: int = 400_000, anon_kb: int = 300_000) -> Path:
    """A fake ``/proc/self`` with ``cgroup`` and ``status`` files."""
    d = tmp_path / "proc"
    write(d / "cgroup", cgroup)
    write(d / "status", f"Name:\tpython\nVmHWM:\t900000 kB\nVmRSS:\t{rss_kb} kB\n"
          f"RssAnon:\t{anon_kb} kB\nRssFile:\t1000 kB\n")  # fmt: skip
    return d


# ----------------------------------------------------------------------- cgroup v2
def test_v2_limit_and_anonymous_memory(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory pids\n")
    write(root / "memory.max", "max\n")
    write(root / "job" / "memory.max", "max\n")
    write(root / "job" / "train" / "memory.max", f"{2 * GiB}\n")
    write(root / "job" / "train" / "memory.stat", f"anon {700 * MiB}\nfile {GiB}\n")
    got = cgroup_memory(root, proc(tmp_path, "0::/job/train\n"))
    assert got is not None
    assert (got.version, got.limit_bytes, got.anon_bytes) == (2, 2 * GiB, 700 * MiB)
    assert got.path == root / "job" / "train"


def test_v2_a_parents_smaller_limit_bounds_the_group(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "job" / "memory.max", f"{GiB}\n")
    write(root / "job" / "train" / "memory.max", f"{4 * GiB}\n")
    got = cgroup_memory(root, proc(tmp_path, "0::/job/train\n"))
    assert got is not None and got.limit_bytes == GiB


def test_v2_without_a_limit_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "memory.max", "max\n")
    write(root / "job" / "memory.max", "max\n")
    assert cgroup_memory(root, proc(tmp_path, "0::/job\n")) is None


def test_v2_inside_a_container_reads_the_root(tmp_path: Path) -> None:
    # The container's own group is its root; /proc/self/cgroup names a path that is
    # not visible inside (or "/").
    root = tmp_path / "cg"
    write(root / "memory.max", f"{3 * GiB}\n")
    write(root / "memory.stat", "anon 1024\n")
    for line in ("0::/\n", "0::/kubepods/pod1/abc\n"):
        got = cgroup_memory(root, proc(tmp_path, line))
        assert got is not None and got.limit_bytes == 3 * GiB and got.path == root


def test_v2_tree_without_the_memory_controller_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "job" / "cpu.max", "max 100000\n")
    assert cgroup_memory(root, proc(tmp_path, "0::/job\n")) is None


# ----------------------------------------------------------------------- cgroup v1
def test_v1_limit_and_rss(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mem = root / "memory"
    write(mem / "memory.limit_in_bytes", V1_NO_LIMIT)
    write(mem / "docker" / "memory.limit_in_bytes", V1_NO_LIMIT)
    write(mem / "docker" / "abc" / "memory.limit_in_bytes", f"{6 * GiB}\n")
    write(
        mem / "docker" / "abc" / "memory.stat",
        f"cache {GiB}\nrss {100 * MiB}\ntotal_rss {500 * MiB}\n"
        f"hierarchical_memory_limit {6 * GiB}\n",
    )
    got = cgroup_memory(root, proc(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n"))
    assert got is not None
    assert (got.version, got.limit_bytes, got.anon_bytes) == (1, 6 * GiB, 500 * MiB)


def test_v1_hierarchical_limit_is_taken_when_smaller(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    group = root / "memory" / "a"
    write(group / "memory.limit_in_bytes", V1_NO_LIMIT)
    write(group / "memory.stat", f"total_rss 10\nhierarchical_memory_limit {GiB}\n")
    got = cgroup_memory(root, proc(tmp_path, "4:memory:/a\n"))
    assert got is not None and got.limit_bytes == GiB


def test_v1_without_a_limit_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "memory" / "memory.limit_in_bytes", V1_NO_LIMIT)
    write(root / "memory" / "memory.stat", f"hierarchical_memory_limit {V1_NO_LIMIT}\n")
    assert cgroup_memory(root, proc(tmp_path, "4:memory:/\n")) is None


def test_hybrid_machine_reads_the_v1_memory_controller(tmp_path: Path) -> None:
    # A v1 memory controller beside a v2 tree without it (this machine's layout).
    root = tmp_path / "cg"
    write(root / "memory" / "job" / "memory.limit_in_bytes", f"{GiB}\n")
    write(root / "unified" / "cgroup.controllers", "")
    got = cgroup_memory(root, proc(tmp_path, "9:name=systemd:/\n4:memory:/job\n0::/\n"))
    assert got is not None and got.version == 1 and got.limit_bytes == GiB


def test_no_cgroup_file_is_none(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path / "cg", tmp_path / "no-proc") is None


# --------------------------------------------------------------------- the probe
def test_container_reading_leaves_out_what_other_processes_use(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "job" / "memory.max", f"{4 * GiB}\n")
    write(root / "job" / "memory.stat", f"anon {GiB + 300_000 * 1024}\n")
    probe = SystemMemory(root, proc(tmp_path, "0::/job\n", anon_kb=300_000))
    reading = probe.read(torch.device("cpu"))
    assert reading is not None
    assert reading.limit_bytes == 3 * GiB  # 4 GiB less the 1 GiB of another process
    assert "cgroup v2" in reading.source and str(root / "job") in reading.source
    assert reading.peak_bytes == peak_rss_bytes()


def test_machine_reading_without_a_container(tmp_path: Path) -> None:
    probe = SystemMemory(tmp_path / "cg", proc(tmp_path, "0::/\n", rss_kb=400_000))
    before = psutil.virtual_memory().available
    reading = probe.read(torch.device("cpu"))
    after = psutil.virtual_memory().available
    assert reading is not None and reading.source.startswith("the machine")
    assert min(before, after) + 400_000 * 1024 - 64 * MiB <= reading.limit_bytes
    assert reading.limit_bytes <= max(before, after) + 400_000 * 1024 + 64 * MiB


def test_process_memory_reads_status(tmp_path: Path) -> None:
    me = process_memory(proc(tmp_path, "0::/\n", rss_kb=123, anon_kb=45))
    assert (me.rss_bytes, me.anon_bytes) == (123 * 1024, 45 * 1024)
    real = process_memory()
    # (The kernel folds per-thread RSS counters in batches: the peak may lag a little.)
    assert 0 < real.anon_bytes <= real.rss_bytes <= peak_rss_bytes() + 4 * MiB


def test_a_device_that_cannot_be_read_is_none() -> None:
    assert SystemMemory().read(torch.device("meta")) is None


def test_this_machine_reads_without_error() -> None:
    reading = SystemMemory().read(torch.device("cpu"))
    assert reading is not None and reading.limit_bytes > 0 and reading.peak_bytes > 0


@pytest.mark.cuda
def test_cuda_reading_is_free_memory_plus_the_allocators_reserve() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
    reading = SystemMemory().read(device)
    free, total = torch.cuda.mem_get_info(device)
    assert reading is not None
    assert free <= reading.limit_bytes <= total
    assert reading.peak_bytes >= 64 * MiB
    assert SystemMemory().peak(device) == torch.cuda.max_memory_allocated(device)
    del x


def test_the_group_directory_whatever_its_limit(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "memory" / "job" / "memory.limit_in_bytes", V1_NO_LIMIT)
    found = memory_cgroup_dir(root, proc(tmp_path, "4:memory:/job\n"))
    assert found == (1, root / "memory" / "job", root / "memory")
    write(root / "memory.max", "max\n")
    write(root / "a" / "memory.max", "max\n")
    assert memory_cgroup_dir(root, proc(tmp_path, "0::/a\n")) == (2, root / "a", root)
    assert memory_cgroup_dir(tmp_path / "none", proc(tmp_path, "0::/a\n")) is None
