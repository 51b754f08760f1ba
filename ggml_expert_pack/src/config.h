// The provider's configuration: the reference design's keys, validated (unknown keys and bad values are
// errors naming the key).
#pragma once

#include <cstdint>
#include <string>

namespace expert_pack {

struct config {
    std::string pack_path;               // experts.pack
    std::string manifest_path;           // manifest.json
    // sizes are in MiB; the JSON also takes strings with a unit ("512M", "8G", "1.5T")
    double      cache_vram_mib        = 0;      // cache budget on each device (CPU: host arena); 0 = all that fits
    double      cache_vram_reserve_mib = 1024;  // left free on each device
    int32_t     stage_slots           = 4;      // staging buffers (4096-aligned; pinned on a GPU)
    int32_t     read_splits           = 1;      // concurrent sub-reads per expert block
    int32_t     read_threads          = 4;      // a step's misses read concurrently by this many threads (queue depth:
                                                // 1.2x decode, 1.5x prefill on the H200's disk, docs/BENCHMARKS.md)
    bool        direct_io             = true;   // O_DIRECT reads; false = buffered (for comparison only)
    std::string stats_path;                     // stats JSON written every stats_flush_interval steps
    int32_t     stats_flush_interval  = 64;
    bool        verify_pack_sha256    = true;   // verify each block's checksum (XXH3-128) as it is read
    double      ram_cache_mib         = 0;      // host-RAM tier of whole expert blocks (pinned on a GPU); 0 = off;
                                                // -1 ("auto"): sized at attach from the memory the process can take
    std::string trace_path;                     // append the router's expert ids per step and layer; "" = off
    std::string ram_tier_mode = "spill";        // spill: blocks rank by popularity (a spare copy of an expert on the
                                                // device goes first) and the device's popular victims are copied back
                                                // into the tier; victim: the same without ranking or copying back (a
                                                // block whose expert is on the device goes first, comes back to the
                                                // front when the device evicts it); inclusive: every block read
    bool        prefetch              = false;  // read the next layer's predicted experts into the RAM tier while
                                                // the device computes (needs ram_cache_mib; one thread of its own)

    std::string to_json() const;
};

// Throws std::invalid_argument with a one-line message naming the key.
config parse_config(const std::string & json_text);

// Every key as JSON: [{"name", "type", "default", "help", "min"/"max" (int), "values" (enum)}] (expert_pack_config_schema).
std::string config_schema_json();

}  // namespace expert_pack
