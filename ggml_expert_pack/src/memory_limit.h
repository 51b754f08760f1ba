// How much more host memory this process can take without swapping or being killed: the kernel's estimate of
// what can be allocated without swapping (MemAvailable: free memory plus the reclaimable page cache), and, for the
// process's cgroup and its ancestors, each memory limit less what that cgroup already uses (v2: memory.max -
// memory.current; v1: memory.limit_in_bytes - memory.usage_in_bytes; pinned memory counts against them; the page
// cache the cgroup holds on its file lists counts in the usage but is taken off it, since the kernel reclaims it
// first, as MemAvailable does). The host-RAM tier is checked against it at start (docs/ARCHITECTURE.md,
// "Sizing the RAM tier"): a tier that cannot fit fails closed instead of swapping or being OOM-killed later.
#pragma once

#include <cstdint>
#include <string>

namespace expert_pack {

struct memory_headroom {
    uint64_t bytes = UINT64_MAX;  // the smaller of the limits found; UINT64_MAX when none could be read
    std::string source;           // which one it is ("MemAvailable", "memory.max - memory.current of cgroup /x")
};

// Reads /proc/meminfo and the process's cgroup v2 or v1 memory files. Test seam: EXPERT_PACK_TEST_MEM_AVAILABLE_MIB replaces
// MemAvailable (a machine's free memory cannot be staged in a test); EXPERT_PACK_TEST_CGROUP_DIR names a directory
// read as the process's only v2 cgroup (memory.max, memory.current, memory.stat written by the test).
memory_headroom host_memory_headroom();

}  // namespace expert_pack
