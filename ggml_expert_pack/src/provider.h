// The provider's objects, shared by the files that implement it (not a public header: expert_pack.h is):
//   provider.cpp        one step of one layer: plan, load the misses, publish the slot ids (the graph op's work)
//   miss_load.cpp       a step's device-cache misses into their slots: through staging, or through the RAM tier
//   attach.cpp          sizing the caches and allocating them when a model loads
//   model_identity.cpp  whether a model file belongs to the pack
//   c_api.cpp           the C API (expert_pack.h)
#pragma once

#include "expert_pack.h"

#include "arena.h"
#include "cache_policy.h"
#include "config.h"
#include "io_engine.h"
#include "io_queue.h"
#include "manifest.h"
#include "prefetch_blocks.h"
#include "ram_tier.h"
#include "ram_tier_mode.h"
#include "staging.h"
#include "stats.h"
#include "timeline.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

struct expert_pack_layer;

// One round of a layer's step (a batch whose distinct experts exceed the cache is served in rounds); the graph's
// ops get it as their userdata.
struct expert_pack_round {
    expert_pack_layer * layer;
    int32_t index;
    int32_t count;
    std::vector<float> mask;  // per (token, pair): 1 if the pair's expert is served in this round, else 0
};

struct expert_pack_layer {
    expert_pack_provider * owner = nullptr;
    const expert_pack::layer_layout * layout = nullptr;
    int32_t moe_index = 0;            // position in the manifest's layer table (the RAM tier's key space)
    std::vector<ggml_tensor *> meta;  // shape/type-only tensors, in the layout's role order (null until created)
    expert_pack::layer_arena arena;
    expert_pack::staging * stage = nullptr;  // the staging buffers of the layer's device
    expert_pack::device_counters * dev_stats = nullptr;  // the layer's device's counters
    bool resident = false;            // every expert preloaded into slot == expert: no per-step work at all
    // the arena's backend needs a token's k slot ids distinct (a GPU's mul_mat_id: duplicates left rows unmapped
    // and it read out of bounds); the CPU's does not
    bool distinct_ids = false;
    std::unique_ptr<expert_pack::hybrid_policy> policy;
    int32_t zero_slot = -1;           // an all-zero slot after the policy's slots: what a round's other pairs read (CPU)
    std::vector<expert_pack::hybrid_policy::access> plan;  // scratch
    std::vector<int32_t> step_order;  // the step's distinct experts, cached ones first (round 0 fills it)
    // next-layer prefetch: the pack layer that follows this one in the model (il + 1), this layer's router as the
    // model holds it (for the previous layer to predict this one with), and the prediction made for its next step
    expert_pack_layer * next = nullptr;
    ggml_tensor * router = nullptr, * router_b = nullptr, * probs_b = nullptr;
    std::vector<int32_t> predicted;
    std::map<std::pair<int32_t, int32_t>, std::unique_ptr<expert_pack_round>> rounds;
};

namespace expert_pack {
struct miss_load;

inline void set_err(char * err, size_t len, const std::string & msg) {
    if (err && len) {
        snprintf(err, len, "%s", msg.c_str());
    }
}

inline uint64_t ns_since(std::chrono::steady_clock::time_point t0) {
    return (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// Throws io_error unless `sum` is expert e's recorded checksum.
void expect_checksum(const layer_layout & lay, int32_t e, const uint8_t sum[16]);

// model_identity.cpp: whether the GGUF at `path` is the pack's trunk (unmodified) or the model it was built from,
// with the hyperparameters the pack depends on. Throws std::runtime_error naming the difference.
void check_model_file(const manifest & man, const char * path);

// The registry of packed expert tensors -> their layer (graph building looks packed tensors up by pointer).
void register_tensor(const ggml_tensor * t, expert_pack_layer * L);
void unregister_tensor(const ggml_tensor * t);
expert_pack_layer * layer_of_tensor(const ggml_tensor * t);
}  // namespace expert_pack

struct expert_pack_provider {
    expert_pack::config cfg;
    expert_pack::manifest man;
    std::unique_ptr<expert_pack::io_engine> io;
    std::unique_ptr<expert_pack::io_queue> reads;      // where a step's miss reads go (read_threads)
    uint64_t max_read = 0;
    std::vector<std::unique_ptr<expert_pack::staging>> stages;  // one set per device that holds arenas
    std::unique_ptr<expert_pack::ram_tier> ram;        // the host-RAM tier (ram_cache_mib > 0), all layers
    std::unique_ptr<expert_pack::ram_tier_mode> ram_mode;  // what the tier keeps (ram_tier_mode)
    std::vector<expert_pack::hybrid_policy::access> ram_plan;  // scratch
    std::unique_ptr<expert_pack::prefetch_blocks> pf;  // prefetch: background reads into RAM-tier blocks
    FILE * trace = nullptr;                            // trace_path: the routing trace being recorded
    bool trace_header = false;                         // its header is written at the first attach
    uint64_t trace_step = 0;                           // steps seen, for the trace (reset_stats does not touch it)
    std::map<int32_t, std::unique_ptr<expert_pack_layer>> layers;  // by model layer index
    std::unordered_map<std::string, std::pair<expert_pack_layer *, size_t>> by_tensor;  // name -> (layer, role)
    ggml_context * meta_ctx = nullptr;
    ggml_context * arena_ctx = nullptr;
    bool attached = false;
    bool rounds_allowed = true;
    int32_t slots_min = 0;
    uint32_t max_ubatch = 0;
    int32_t n_expert_used = 0;

    expert_pack::counters stats;
    std::vector<std::unique_ptr<expert_pack::device_counters>> devices;  // per device with arenas (attach)
    std::mutex err_mu;
    std::string last_error;
    bool step_failed = false;     // the current step failed: its remaining layers skip their loads
    uint64_t counted_short_reads = 0;
    bool failure_pending = false; // reported by expert_pack_take_step_error
    int32_t last_layer = INT32_MAX;
    bool test_distinct_slots = false;  // test seam: the GPU's slot assignment for rounds on the CPU
    bool test_hold_prefetch = false;   // test seam: no prefetch read starts (also for a prefetcher made at attach)
    expert_pack::step_timeline timeline;            // the last step's per-layer marks (expert_pack_timeline_json)
    expert_pack::step_timeline::layer_marks * marks = nullptr;  // the acquiring layer's
    std::string summary;               // how the cache was sized (expert_pack_summary), set at attach
    size_t n_resident = 0;             // layers with every expert preloaded
    bool acquired = false;             // some layer acquired in the current graph compute (step_done resets it)

    // attach.cpp
    void open(const char * config_json);  // throws, naming the cause
    ~expert_pack_provider();
    void attach(int n_layer, ggml_backend_dev_t const * layer_devs, int n_expert_used);  // throws, detached
    void detach();

    // provider.cpp
    std::string geometry_json() const;
    void flush_stats();
    void count_step();
    void fail_step(const std::string & msg);
    void count_cache(expert_pack_layer * L, uint64_t hits, uint64_t misses, uint64_t evictions);
    void acquire(expert_pack_layer * L, int32_t round, int32_t n_rounds, ggml_tensor * dst, std::vector<float> * mask);
    void preload(expert_pack_layer * L);
    // one expert block read into `dst`, checked against its checksum (when verify_pack_sha256) as it lands
    expert_pack::read_request block_request(const expert_pack::layer_layout & lay, int32_t expert, uint8_t * dst,
                                            expert_pack::step_timeline::read_marks * rm = nullptr);
    void read_block(const expert_pack::layer_layout & lay, int32_t expert, uint8_t * dst);  // synchronous
    void record_trace(const expert_pack::layer_layout & lay, const ggml_tensor * ids);
    void prefetch(expert_pack_layer * N, const ggml_tensor * pred);
    bool order_step(expert_pack_layer * L, const ggml_tensor * ids);
    void map_round_slots(const expert_pack_layer * L, const std::vector<int32_t> & unique, const ggml_tensor * ids,
                         int32_t * out, std::vector<float> * mask) const;

    // miss_load.cpp
    void load_via_staging(expert_pack::miss_load & m);
    template <class Submit, class OnDone>
    void stage_loop(expert_pack::miss_load & m, std::vector<size_t> & buf_of, const Submit & submit,
                    const OnDone & on_done);
    void load_via_ram_tier(expert_pack::miss_load & m);
    void spill(expert_pack_layer * L, size_t g, size_t n, const std::vector<size_t> & miss);
    void reclaim_block(int32_t b) { if (pf) pf->reclaim(b); }
};
