// The provider's counters (per unique (layer, expert) key per step) and the stats file.
#pragma once

#include "expert_pack.h"

#include <atomic>
#include <string>

namespace expert_pack {

struct counters {
    std::atomic<uint64_t> cache_hits{0};
    std::atomic<uint64_t> cache_misses{0};
    std::atomic<uint64_t> cache_evictions{0};
    std::atomic<uint64_t> pack_read_bytes{0};
    std::atomic<uint64_t> h2d_bytes{0};
    std::atomic<uint64_t> fallback_count{0};
    std::atomic<uint64_t> io_errors{0};
    std::atomic<uint64_t> steps{0};
    std::atomic<uint64_t> ram_hits{0};
    std::atomic<uint64_t> ram_misses{0};
    std::atomic<uint64_t> ram_evictions{0};
    std::atomic<uint64_t> ram_spills{0};
    std::atomic<uint64_t> ram_blocks{0};    // geometry, not a counter: reset() keeps it
    std::atomic<uint64_t> ram_bytes{0};
    std::atomic<uint64_t> prefetch_issued{0};
    std::atomic<uint64_t> prefetch_used{0};
    std::atomic<uint64_t> prefetch_wasted{0};
    std::atomic<uint64_t> prefetch_cancelled{0};
    std::atomic<uint64_t> predicted{0};
    std::atomic<uint64_t> predicted_correct{0};
    // where acquire time goes (the step profile of docs/BENCHMARKS.md)
    std::atomic<uint64_t> acquire_ns{0};    // inside the graph op, all of it
    std::atomic<uint64_t> read_ns{0};       // inside pack reads
    std::atomic<uint64_t> copy_wait_ns{0};  // waiting for copies into the cache to complete
    std::atomic<uint64_t> prefetch_wait_ns{0};  // the graph's ops waiting for running prefetch reads (one the step
                                                // needs, or one whose block is to be reused)

    expert_pack_stats snapshot() const;
    void reset();
};

// One device's share of the cache counters (the layers whose arenas it holds), for the per-device figures of the
// stats file and /metrics: with llama.cpp's layer split every device has its own cache, sized from its own memory.
struct device_counters {
    std::string name;
    int32_t slots = 0;          // per layer
    size_t n_layers = 0, n_resident = 0;
    uint64_t cache_bytes = 0;
    std::atomic<uint64_t> cache_hits{0};
    std::atomic<uint64_t> cache_misses{0};
    std::atomic<uint64_t> cache_evictions{0};
    std::atomic<uint64_t> h2d_bytes{0};

    void reset() { cache_hits = cache_misses = cache_evictions = h2d_bytes = 0; }
    std::string to_json() const;  // {"device", "layers", "resident_layers", "slots_per_layer", "cache_bytes", counters}
};

// The stats file's JSON: the counters, derived rates, the timings and `extra` (a JSON object's members, e.g.
// the geometry).
std::string stats_json(const expert_pack_stats & s, const counters & c, const std::string & extra_members);

// Write `text` to `path` atomically (temporary file + rename); false on failure.
bool write_file_atomic(const std::string & path, const std::string & text);

}  // namespace expert_pack
