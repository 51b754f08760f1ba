#include "memory_limit.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace expert_pack {

// MemAvailable from /proc/meminfo, in bytes; UINT64_MAX if absent.
static uint64_t mem_available() {
    if (const char * v = getenv("EXPERT_PACK_TEST_MEM_AVAILABLE_MIB"); v && *v) {
        return (uint64_t) (std::strtod(v, nullptr) * 1024 * 1024);
    }
    std::ifstream f("/proc/meminfo");
    std::string key, unit;
    uint64_t kib = 0;
    while (f >> key >> kib) {
        std::getline(f, unit);
        if (key == "MemAvailable:") {
            return kib * 1024;
        }
    }
    return UINT64_MAX;
}

// This process's cgroup paths: the v2 one ("0::/path"), and the v1 memory controller's ("N:...memory...:/path").
static void cgroup_paths(std::string & v2, std::string & v1_memory) {
    std::ifstream f("/proc/self/cgroup");
    std::string line;
    while (std::getline(f, line)) {
        const size_t a = line.find(':'), b = line.find(':', a + 1);
        if (a == std::string::npos || b == std::string::npos) {
            continue;
        }
        const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
        if (line.rfind("0::", 0) == 0) {
            v2 = line.substr(b + 1);
        } else if (controllers.find(",memory,") != std::string::npos) {
            v1_memory = line.substr(b + 1);
        }
    }
}

static bool read_u64(const std::string & path, uint64_t & out) {
    std::ifstream f(path);
    std::string s;
    if (!(f >> s) || s == "max") {
        return false;
    }
    std::istringstream in(s);
    return (bool) (in >> out) && out < (1ull << 60);  // cgroup v1 writes "no limit" as a number near 2^63
}

// The page cache a cgroup holds on its file LRU lists (memory.stat: active_file + inactive_file; v1's hierarchical
// total_ keys where present). The kernel reclaims it before failing an allocation against the limit, and
// MemAvailable counts it the same way; without it, a cgroup that had just read the trunk (the page cache counts in
// memory.current) looked full: the H200's benchmark cgroup (memory.max 3.6 GB) refused a 1714 MiB tier with
// "only 1297 MiB more" that it had run with before this check existed. Shared memory sits on the anon lists, so
// it is not counted.
static uint64_t reclaimable_file_cache(const std::string & stat_path) {
    std::ifstream f(stat_path);
    std::string key;
    uint64_t v = 0, plain = 0, total = 0;
    bool has_total = false;
    while (f >> key >> v) {
        if (key == "active_file" || key == "inactive_file") {
            plain += v;
        } else if (key == "total_active_file" || key == "total_inactive_file") {
            total += v;
            has_total = true;
        }
    }
    return has_total ? total : plain;
}

// The tightest limit - (usage - reclaimable page cache) over a cgroup directory and its ancestors up to `root` (in
// a container's cgroup namespace the root seen is the container's own cgroup, which may carry the limit; the
// host's root has none).
static void walk_cgroups(const std::string & root, std::string dir, const char * limit_file, const char * usage_file,
                         memory_headroom & h) {
    while (!dir.empty() && dir.back() == '/') {
        dir.pop_back();
    }
    for (;; dir = dir.substr(0, dir.rfind('/'))) {
        uint64_t max = 0, cur = 0;
        if (read_u64(dir + "/" + limit_file, max) && read_u64(dir + "/" + usage_file, cur)) {
            const uint64_t cache = std::min(cur, reclaimable_file_cache(dir + "/memory.stat"));
            const uint64_t used = cur - cache;
            const uint64_t left = max > used ? max - used : 0;
            if (left < h.bytes) {
                const std::string name = dir.size() > root.size() ? dir.substr(root.size()) : "/";
                h = {left, std::string(limit_file) + " - (" + usage_file + " - page cache " +
                               std::to_string(cache >> 20) + " MiB) of cgroup " + name};
            }
        }
        if (dir.size() <= root.size()) {
            break;
        }
    }
}

memory_headroom host_memory_headroom() {
    memory_headroom h;
    if (const uint64_t avail = mem_available(); avail != UINT64_MAX) {
        h = {avail, "MemAvailable"};
    }
    // the process's cgroup and every ancestor: any of them may carry the limit
    if (const char * dir = getenv("EXPERT_PACK_TEST_CGROUP_DIR"); dir && *dir) {
        walk_cgroups(dir, dir, "memory.max", "memory.current", h);
        return h;
    }
    std::string v2, v1;
    cgroup_paths(v2, v1);
    if (!v2.empty()) {
        walk_cgroups("/sys/fs/cgroup", "/sys/fs/cgroup" + v2, "memory.max", "memory.current", h);
    }
    if (!v1.empty()) {
        walk_cgroups("/sys/fs/cgroup/memory", "/sys/fs/cgroup/memory" + v1, "memory.limit_in_bytes",
                     "memory.usage_in_bytes", h);
    }
    return h;
}

}  // namespace expert_pack
