#include "stats.h"

#include <cstdio>
#include <unistd.h>

namespace expert_pack {

expert_pack_stats counters::snapshot() const {
    expert_pack_stats s;
    s.cache_hits = cache_hits.load();
    s.cache_misses = cache_misses.load();
    s.cache_evictions = cache_evictions.load();
    s.pack_read_bytes = pack_read_bytes.load();
    s.h2d_bytes = h2d_bytes.load();
    s.fallback_count = fallback_count.load();
    s.io_errors = io_errors.load();
    s.steps = steps.load();
    s.ram_hits = ram_hits.load();
    s.ram_misses = ram_misses.load();
    s.ram_evictions = ram_evictions.load();
    s.ram_spills = ram_spills.load();
    s.ram_blocks = ram_blocks.load();
    s.ram_bytes = ram_bytes.load();
    s.prefetch_issued = prefetch_issued.load();
    s.prefetch_used = prefetch_used.load();
    s.prefetch_wasted = prefetch_wasted.load();
    s.prefetch_cancelled = prefetch_cancelled.load();
    s.predicted = predicted.load();
    s.predicted_correct = predicted_correct.load();
    return s;
}

void counters::reset() {
    cache_hits = cache_misses = cache_evictions = pack_read_bytes = h2d_bytes = fallback_count = io_errors = steps = 0;
    ram_hits = ram_misses = ram_evictions = ram_spills = 0;
    prefetch_issued = prefetch_used = prefetch_wasted = prefetch_cancelled = predicted = predicted_correct = 0;
    acquire_ns = read_ns = copy_wait_ns = prefetch_wait_ns = 0;
}

std::string device_counters::to_json() const {
    const uint64_t h = cache_hits, m = cache_misses;
    char buf[512];
    snprintf(buf, sizeof(buf),
             "{\"device\":\"%s\",\"layers\":%zu,\"resident_layers\":%zu,\"slots_per_layer\":%d,\"cache_bytes\":%llu,"
             "\"cache_hits\":%llu,\"cache_misses\":%llu,\"cache_evictions\":%llu,\"h2d_bytes\":%llu,\"hit_rate\":%.6f}",
             name.c_str(), n_layers, n_resident, slots, (unsigned long long) cache_bytes, (unsigned long long) h,
             (unsigned long long) m, (unsigned long long) cache_evictions.load(), (unsigned long long) h2d_bytes.load(),
             h + m ? (double) h / (double) (h + m) : 0.0);
    return buf;
}

std::string stats_json(const expert_pack_stats & s, const counters & c, const std::string & extra) {
    const uint64_t keys = s.cache_hits + s.cache_misses;
    char buf[1024];
    snprintf(buf, sizeof(buf),
             "{\"cache_hits\":%llu,\"cache_misses\":%llu,\"cache_evictions\":%llu,\"pack_read_bytes\":%llu,"
             "\"h2d_bytes\":%llu,\"fallback_count\":%llu,\"io_errors\":%llu,\"steps\":%llu,\"hit_rate\":%.6f",
             (unsigned long long) s.cache_hits, (unsigned long long) s.cache_misses,
             (unsigned long long) s.cache_evictions, (unsigned long long) s.pack_read_bytes,
             (unsigned long long) s.h2d_bytes, (unsigned long long) s.fallback_count,
             (unsigned long long) s.io_errors, (unsigned long long) s.steps,
             keys ? (double) s.cache_hits / (double) keys : 0.0);
    std::string out = buf;
    const uint64_t ram_keys = s.ram_hits + s.ram_misses;
    snprintf(buf, sizeof(buf),
             ",\"ram_hits\":%llu,\"ram_misses\":%llu,\"ram_evictions\":%llu,\"ram_spills\":%llu,\"ram_blocks\":%llu,"
             "\"ram_bytes\":%llu,\"ram_hit_rate\":%.6f",
             (unsigned long long) s.ram_hits, (unsigned long long) s.ram_misses, (unsigned long long) s.ram_evictions,
             (unsigned long long) s.ram_spills,
             (unsigned long long) s.ram_blocks, (unsigned long long) s.ram_bytes,
             ram_keys ? (double) s.ram_hits / (double) ram_keys : 0.0);
    out += buf;
    snprintf(buf, sizeof(buf),
             ",\"prefetch_issued\":%llu,\"prefetch_used\":%llu,\"prefetch_wasted\":%llu,\"prefetch_cancelled\":%llu,"
             "\"predicted\":%llu,\"predicted_correct\":%llu,\"prediction_accuracy\":%.6f",
             (unsigned long long) s.prefetch_issued, (unsigned long long) s.prefetch_used,
             (unsigned long long) s.prefetch_wasted, (unsigned long long) s.prefetch_cancelled,
             (unsigned long long) s.predicted, (unsigned long long) s.predicted_correct,
             s.predicted ? (double) s.predicted_correct / (double) s.predicted : 0.0);
    out += buf;
    snprintf(buf, sizeof(buf), ",\"acquire_ms\":%.3f,\"read_ms\":%.3f,\"copy_wait_ms\":%.3f,\"prefetch_wait_ms\":%.3f",
             c.acquire_ns.load() / 1e6, c.read_ns.load() / 1e6, c.copy_wait_ns.load() / 1e6,
             c.prefetch_wait_ns.load() / 1e6);
    out += buf;
    if (!extra.empty()) {
        out += "," + extra;
    }
    return out + "}";
}

bool write_file_atomic(const std::string & path, const std::string & text) {
    const std::string tmp = path + ".tmp." + std::to_string(getpid());
    FILE * f = fopen(tmp.c_str(), "w");
    if (!f) {
        return false;
    }
    const bool ok = fwrite(text.data(), 1, text.size(), f) == text.size() && fputc('\n', f) != EOF;
    if (fclose(f) != 0 || !ok) {
        remove(tmp.c_str());
        return false;
    }
    return rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace expert_pack
