// The provider: ties the pack (manifest + I/O engine), the per-layer caches (arena + policy) and the counters
// together, and implements the C API (expert_pack.h). The graph op `expert_pack_acquire` is the hot path.
#include "expert_pack.h"

#include "arena.h"
#include "cache_policy.h"
#include "config.h"
#include "io_engine.h"
#include "manifest.h"
#include "memory_limit.h"
#include "prefetch.h"
#include "ram_tier.h"
#include "read_pool.h"
#include "staging.h"
#include "stats.h"
#include "timeline.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

using namespace expert_pack;

namespace {

void set_err(char * err, size_t len, const std::string & msg) {
    if (err && len) {
        snprintf(err, len, "%s", msg.c_str());
    }
}

struct aligned_buffer {
    uint8_t * ptr = nullptr;
    explicit aligned_buffer(size_t n) {
        if (posix_memalign((void **) &ptr, PACK_ALIGNMENT, n) != 0) {
            throw std::runtime_error("cannot allocate a " + std::to_string(n) + "-byte staging buffer");
        }
        if ((uintptr_t) ptr % PACK_ALIGNMENT) {  // O_DIRECT needs it; never read into a misaligned buffer
            throw std::runtime_error("misaligned staging buffer");
        }
    }
    ~aligned_buffer() { free(ptr); }
    aligned_buffer(const aligned_buffer &) = delete;
    aligned_buffer & operator=(const aligned_buffer &) = delete;
};

// packed expert tensor -> its layer (graph building looks packed tensors up here)
std::mutex g_registry_mu;
std::unordered_map<const ggml_tensor *, expert_pack_layer *> g_registry;

}  // namespace

struct expert_pack_round {
    expert_pack_layer * layer;
    int32_t index;
    int32_t count;
    std::vector<float> mask;  // per (token, pair): 1 if the pair's expert is served in this round, else 0
};

struct expert_pack_layer {
    expert_pack_provider * owner = nullptr;
    const layer_layout * layout = nullptr;
    int32_t moe_index = 0;            // position in the manifest's layer table (the RAM tier's key space)
    std::vector<ggml_tensor *> meta;  // shape/type-only tensors, in the layout's role order (null until created)
    layer_arena arena;
    staging * stage = nullptr;        // the staging buffers of the layer's device
    bool resident = false;            // every expert preloaded into slot == expert: no per-step work at all
    std::unique_ptr<hybrid_policy> policy;
    int32_t zero_slot = -1;           // an all-zero slot after the policy's slots: what a round's other pairs read (CPU)
    std::vector<hybrid_policy::access> plan;  // scratch
    std::vector<int32_t> step_order;  // the step's distinct experts, cached ones first (round 0 fills it)
    // next-layer prefetch: the pack layer that follows this one in the model (il + 1), this layer's router as the
    // model holds it (for the previous layer to predict this one with), and the prediction made for its next step
    expert_pack_layer * next = nullptr;
    ggml_tensor * router = nullptr, * router_b = nullptr, * probs_b = nullptr;
    std::vector<int32_t> predicted;
    std::map<std::pair<int32_t, int32_t>, std::unique_ptr<expert_pack_round>> rounds;
};

struct miss_load;

struct expert_pack_provider {
    config cfg;
    manifest man;
    std::unique_ptr<io_engine> io;
    std::unique_ptr<read_pool> reads;              // read_threads workers for a step's misses (inline with 1)
    uint64_t max_read = 0;
    std::vector<std::unique_ptr<staging>> stages;  // one set per device that holds arenas
    std::unique_ptr<ram_tier> ram;                 // the host-RAM tier (ram_cache_mib > 0), all layers
    std::vector<hybrid_policy::access> ram_plan;   // scratch
    std::unique_ptr<prefetcher> pf;                // prefetch: background reads into RAM-tier blocks
    std::vector<char> pf_unused;                   // per RAM block: holds (or is reading) a prefetch not yet used
    std::vector<int32_t> pf_busy;                  // RAM blocks marked busy in the tier's policy: a prefetch read
                                                   // submitted and not yet seen finished (mark_busy, refresh_busy)
    bool spill_tier = false;                       // ram_tier_mode "spill" (and a tier)
    FILE * trace = nullptr;                        // trace_path: the routing trace being recorded
    bool trace_header = false;                     // its header is written at the first attach
    uint64_t trace_step = 0;                       // steps seen, for the trace (reset_stats does not touch it)
    std::map<int32_t, std::unique_ptr<expert_pack_layer>> layers;  // by model layer index
    std::unordered_map<std::string, std::pair<expert_pack_layer *, size_t>> by_tensor;  // name -> (layer, role)
    ggml_context * meta_ctx = nullptr;
    ggml_context * arena_ctx = nullptr;
    bool attached = false;
    bool rounds_allowed = true;
    int32_t slots_min = 0;
    uint32_t max_ubatch = 0;
    int32_t n_expert_used = 0;

    counters stats;
    std::mutex err_mu;
    std::string last_error;
    bool step_failed = false;     // the current step failed: its remaining layers skip their loads
    uint64_t counted_short_reads = 0;
    bool failure_pending = false; // reported by expert_pack_take_step_error
    int32_t last_layer = INT32_MAX;
    bool test_distinct_slots = false;  // test seam: the GPU's slot assignment for rounds on the CPU
    bool test_hold_prefetch = false;   // test seam: no prefetch read starts (also for a prefetcher made at attach)
    step_timeline timeline;            // the last step's per-layer marks (expert_pack_timeline_json)
    step_timeline::layer_marks * marks = nullptr;  // the acquiring layer's
    std::string summary;               // how the cache was sized (expert_pack_summary), set at attach
    size_t n_resident = 0;             // layers with every expert preloaded
    bool acquired = false;             // some layer acquired in the current graph compute (step_done resets it)

    ~expert_pack_provider() {
        detach();
        if (trace) fclose(trace);  // flushes the trace
        {
            std::lock_guard<std::mutex> lk(g_registry_mu);
            for (auto & [_, l] : layers) {
                for (auto * t : l->meta) {
                    if (t) g_registry.erase(t);
                }
            }
        }
        if (meta_ctx) ggml_free(meta_ctx);
    }

    void detach() {
        pf.reset();   // before the RAM tier: its reads write into the tier's blocks
        pf_unused.clear();
        pf_busy.clear();
        for (auto & [_, l] : layers) {
            free_arena(l->arena);
            l->policy.reset();
            l->router = l->router_b = l->probs_b = nullptr;  // the model's tensors go with the model
            l->predicted.clear();
            l->stage = nullptr;
            l->resident = false;
            l->zero_slot = -1;
            l->rounds.clear();
        }
        ram.reset();  // before the stages: its blocks may wait on their copies
        spill_tier = false;
        stats.ram_blocks = 0;
        stats.ram_bytes = 0;
        stages.clear();
        summary.clear();
        n_resident = 0;
        if (arena_ctx) {
            ggml_free(arena_ctx);
            arena_ctx = nullptr;
        }
        attached = false;
    }

    std::string geometry_json() const {
        uint64_t cache_bytes = 0;
        for (const auto & [_, l] : layers) {
            if (l->arena.buffer) cache_bytes += ggml_backend_buffer_get_size(l->arena.buffer);
        }
        size_t n_resident = 0;
        for (const auto & [_, l] : layers) {
            n_resident += l->resident;
        }
        std::string s = "\"pack_id\":\"" + man.pack_id + "\",\"n_layers\":" + std::to_string(layers.size()) +
                        ",\"resident_layers\":" + std::to_string(n_resident) +
                        ",\"n_experts\":" + std::to_string(man.n_experts) +
                        ",\"slots_per_layer\":" + std::to_string(slots_min) +
                        ",\"max_ubatch\":" + std::to_string(max_ubatch) +
                        ",\"cache_bytes\":" + std::to_string(cache_bytes) +
                        ",\"direct_io\":" + (io && io->direct() ? "true" : "false") +
                        ",\"pinned_staging\":" + (!stages.empty() && stages.front()->pinned() ? "true" : "false") +
                        ",\"ram_block_bytes\":" + std::to_string(ram ? ram->block_bytes() : 0) +
                        ",\"ram_pinned\":" + (ram && ram->pinned() ? "true" : "false") +
                        ",\"config\":" + cfg.to_json();
        return s;
    }

    void flush_stats() {
        if (!cfg.stats_path.empty()) {
            write_file_atomic(cfg.stats_path, stats_json(stats.snapshot(), stats, geometry_json()));
        }
        if (trace) fflush(trace);
    }

    void count_step() {
        const uint64_t step = ++stats.steps;
        if (!cfg.stats_path.empty() && step % (uint64_t) cfg.stats_flush_interval == 0) {
            flush_stats();
        }
    }

    void fail_step(const std::string & msg) {
        std::lock_guard<std::mutex> lk(err_mu);
        last_error = msg;
        step_failed = true;
        failure_pending = true;
    }

    void acquire(expert_pack_layer * L, int32_t round, int32_t n_rounds, ggml_tensor * dst, std::vector<float> * mask);
    void preload(expert_pack_layer * L);
    void read_block(const layer_layout & lay, int32_t expert, uint8_t * dst, step_timeline::read_marks * rm = nullptr);
    void record_trace(const layer_layout & lay, const ggml_tensor * ids);
    void prefetch(expert_pack_layer * N, const ggml_tensor * pred);
    void settle_prefetches();
    void mark_busy(int32_t b);
    void refresh_busy();
    void reclaim_block(int32_t b);
    bool cancel_prefetch(int32_t b);
    void prefetch_dropped(int32_t b);
    std::exception_ptr wait_prefetch(int32_t b);
    void spill(expert_pack_layer * L, size_t g, size_t n, const std::vector<size_t> & miss);
    void load_via_staging(miss_load & m);
    template <class Submit, class OnDone>
    void stage_loop(miss_load & m, std::vector<size_t> & buf_of, const Submit & submit, const OnDone & on_done);
    void load_via_ram_tier(miss_load & m);
    bool order_step(expert_pack_layer * L, const ggml_tensor * ids);
    void map_round_slots(const expert_pack_layer * L, const std::vector<int32_t> & unique, const ggml_tensor * ids,
                         int32_t * out, std::vector<float> * mask) const;
};

// The device-cache misses of one acquire on their way into their slots (from the pack through a staging buffer, or
// through the RAM tier). Reads go to the read pool (read_threads; inline with 1) and are collected in the order they
// land; each landed block's copy into its slot starts at once. After the first failure nothing more is submitted or
// copied, and the reads still in flight are drained (they write into our buffers) before the load returns.
struct miss_load {
    expert_pack_provider & p;
    expert_pack_layer * L;
    const layer_layout & lay;
    std::vector<size_t> miss;    // the plan's misses (indices into L->plan), in plan order
    std::vector<char> stored;    // miss j's expert is in its device slot
    uint64_t misses = 0, evictions = 0;
    std::exception_ptr failure;  // the first one
    size_t outstanding = 0;      // reads submitted and not yet collected

    // the chunked path (read_splits > 1 through staging): miss j is read_chunks jobs of chunk_bytes, tag j * n + c
    struct chunked_block {
        std::mutex mu;
        std::vector<char> landed;
        size_t hashed = 0;        // chunks hashed so far, in order
        bool hashing = false;     // a read thread is hashing this block now
        expert_pack_hasher * h = nullptr;
        size_t remaining = 0;     // chunk jobs not yet collected (acquiring thread only)
        std::vector<char> collected;  // chunks collected (acquiring thread only)
        size_t copied = 0;        // chunks whose copy into the slot is issued, in order (acquiring thread only)
        ~chunked_block() { if (h) expert_pack_hasher_free(h); }
    };
    size_t read_chunks = 1, chunk_bytes = 0;
    std::vector<std::unique_ptr<chunked_block>> blocks;

    miss_load(expert_pack_provider & p, expert_pack_layer * L) : p(p), L(L), lay(*L->layout) {
        for (size_t i = 0; i < L->plan.size(); ++i) {
            if (!L->plan[i].hit) miss.push_back(i);
        }
        stored.assign(miss.size(), 0);
    }

    // miss j's expert is in its slot (or its copy is queued on the copy stream, which finish() completes)
    void loaded(size_t j) {
        if (p.marks && j < p.marks->reads.size()) p.marks->reads[j].copy = step_timeline::now();
        p.stats.h2d_bytes += lay.block_bytes;
        ++misses;
        evictions += L->plan[miss[j]].evicted >= 0;
        stored[j] = 1;
    }

    // the next read to land: on_read(j) unless a read has failed
    template <class F> void collect(const F & on_read) {
        auto [j, err] = p.reads->next();
        --outstanding;
        if (err && !failure) failure = err;
        if (!failure) on_read(j);
    }

    void submit_read(size_t j, uint8_t * dst) {
        const int32_t e = L->plan[miss[j]].expert;
        ++outstanding;
        step_timeline::read_marks * rm = nullptr;
        if (p.marks && j < p.marks->reads.size()) {
            rm = &p.marks->reads[j];
            rm->expert = e;
            rm->issue = step_timeline::now();
        }
        p.reads->submit(j, [pp = &p, l = &lay, e, dst, rm] { pp->read_block(*l, e, dst, rm); });
    }

    // miss j as read_chunks jobs: each reads its chunk; the block's checksum advances chunk by chunk in order on
    // whichever read thread holds the next chunk, so it overlaps the reads of the later chunks
    void submit_chunked(size_t j, uint8_t * dst) {
        const int32_t e = L->plan[miss[j]].expert;
        if (blocks.size() < miss.size()) blocks.resize(miss.size());
        blocks[j] = std::make_unique<chunked_block>();
        chunked_block * b = blocks[j].get();
        b->landed.assign(read_chunks, 0);
        b->collected.assign(read_chunks, 0);
        b->remaining = read_chunks;
        if (p.cfg.verify_pack_sha256) b->h = expert_pack_hasher_new();
        if (p.marks && j < p.marks->reads.size()) {
            auto & rm = p.marks->reads[j];
            rm.expert = e;
            rm.issue = rm.start = step_timeline::now();
        }
        for (size_t c = 0; c < read_chunks; ++c) {
            ++outstanding;
            p.reads->submit(j * read_chunks + c, [this, b, e, dst, c] { read_chunk(b, e, dst, c); });
        }
    }

    void read_chunk(chunked_block * b, int32_t e, uint8_t * dst, size_t c) {
        const uint64_t off = c * chunk_bytes;
        const uint64_t n = std::min<uint64_t>(chunk_bytes, lay.read_bytes - off);
        const auto t0 = clk_now();
        p.io->read_whole(dst + off, lay.expert_offset(e) + off, n);
        p.stats.read_ns += ns_between(t0, clk_now());
        p.stats.pack_read_bytes += n;
        if (!b->h) {
            return;
        }
        std::unique_lock<std::mutex> lk(b->mu);
        b->landed[c] = 1;
        if (b->hashing) {
            return;  // the thread hashing this block takes this chunk in turn
        }
        b->hashing = true;
        while (b->hashed < read_chunks && b->landed[b->hashed]) {
            const uint64_t at = b->hashed * chunk_bytes;
            lk.unlock();
            if (at < lay.block_bytes) {
                expert_pack_hasher_update(b->h, dst + at, std::min<uint64_t>(chunk_bytes, lay.block_bytes - at));
            }
            lk.lock();
            ++b->hashed;
        }
        b->hashing = false;
        if (b->hashed < read_chunks) {
            return;
        }
        lk.unlock();
        uint8_t sum[16];
        expert_pack_hasher_digest(b->h, sum);
        if (memcmp(sum, lay.checksums[e].data(), 16) != 0) {
            throw io_error("checksum mismatch in layer " + std::to_string(lay.layer) + " expert " + std::to_string(e) +
                           " (pack offset " + std::to_string(lay.expert_offset(e)) + "): expected " +
                           to_hex(lay.checksums[e].data(), 16) + ", read " + to_hex(sum, 16));
        }
    }

    static std::chrono::steady_clock::time_point clk_now() { return std::chrono::steady_clock::now(); }
    static uint64_t ns_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
        return (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
    }
};

using clk = std::chrono::steady_clock;

static uint64_t ns_since(clk::time_point t0) {
    return (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now() - t0).count();
}

// One expert block from the pack into `dst` (4096-aligned: a staging buffer or a RAM-tier block), checked
// against its checksum. Throws io_error (read failure, checksum mismatch).
void expert_pack_provider::read_block(const layer_layout & lay, int32_t expert, uint8_t * dst,
                                      step_timeline::read_marks * rm) {
    const auto t0 = clk::now();
    if (rm) rm->start = step_timeline::now();
    io->read(dst, lay.expert_offset(expert), lay.read_bytes);
    stats.read_ns += ns_since(t0);
    stats.pack_read_bytes += lay.read_bytes;
    if (rm) rm->io = step_timeline::now();
    struct hash_mark {
        step_timeline::read_marks * rm;
        ~hash_mark() { if (rm) rm->hash = step_timeline::now(); }
    } hm{rm};
    if (cfg.verify_pack_sha256) {
        uint8_t sum[16];
        expert_pack_xxh3_128(dst, lay.block_bytes, sum);
        if (memcmp(sum, lay.checksums[expert].data(), 16) != 0) {
            throw io_error("checksum mismatch in layer " + std::to_string(lay.layer) + " expert " +
                           std::to_string(expert) + " (pack offset " + std::to_string(lay.expert_offset(expert)) +
                           "): expected " + to_hex(lay.checksums[expert].data(), 16) + ", read " + to_hex(sum, 16));
        }
    }
}

// Every expert of the layer fits: load them all now into slot == expert. The graph then reads the cache with
// the router's own ids and the CPU round trip of the hook disappears (all-hit speed). The RAM tier is not
// involved (the layer never misses again). The load is not a miss: its bytes count (pack_read_bytes, h2d_bytes),
// and every later step of the layer counts as hits (expert_pack_step_done).
void expert_pack_provider::preload(expert_pack_layer * L) {
    const layer_layout & lay = *L->layout;
    for (int32_t e = 0; e < man.n_experts; ++e) {
        uint8_t * buf = L->stage->acquire();
        try {
            read_block(lay, e, buf);
        } catch (const io_error &) {
            stats.io_errors++;
            throw;
        }
        L->stage->store(L->arena, e, lay.block_bytes);
        stats.h2d_bytes += lay.block_bytes;
    }
    L->stage->finish();
    L->resident = true;
}

// The trace file (trace_path, docs/FORMAT.md "Routing traces"): one record per acquired layer and step.
void expert_pack_provider::record_trace(const layer_layout & lay, const ggml_tensor * ids) {
    const int64_t k = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];
    const struct { uint64_t step; uint32_t layer; uint32_t n_tokens; } head = {trace_step, (uint32_t) lay.layer,
                                                                              (uint32_t) n_tokens};
    static_assert(sizeof(head) == 16, "record header is 16 bytes");
    bool ok = fwrite(&head, sizeof(head), 1, trace) == 1;
    for (int64_t t = 0; ok && t < n_tokens; ++t) {
        ok = fwrite((const char *) ids->data + t * ids->nb[1], sizeof(int32_t), (size_t) k, trace) == (size_t) k;
    }
    if (!ok) {  // a diagnostic must not stop inference: stop recording, say so once
        fprintf(stderr, "expert-pack: writing the routing trace %s failed (%s); recording stopped\n",
                cfg.trace_path.c_str(), strerror(errno));
        fclose(trace);
        trace = nullptr;
    }
}

// ---- next-layer prefetch ------------------------------------------------------------------------------------
// At layer L the graph applies layer N = L + 1's router to L's router input and hands the top-k here, after L's
// acquire has loaded what L needs (demand first). The predicted experts that are neither on N's device nor in the
// RAM tier get RAM blocks and background reads, which run while the device computes L's experts and N's attention.
// A guess only ever takes RAM-tier blocks (never a device slot, never a block the current step still copies from),
// gains no frequency in the tier (a wrong guess keeps the rank its expert had), and at N's acquire every read not
// started yet is dropped before N reads anything itself (settle_prefetches). Output is never affected: a used
// prefetch is just a RAM hit.
void expert_pack_provider::prefetch(expert_pack_layer * N, const ggml_tensor * pred) {
    if (!pf || step_failed || !N->policy || N->resident) {
        return;
    }
    const int64_t k = pred->ne[0];
    const int64_t n_tokens = pred->ne[1];
    std::vector<char> seen(man.n_experts, 0);
    N->predicted.clear();
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) pred->data + t * pred->nb[1]);
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = row[j];
            if (e >= 0 && e < man.n_experts && !seen[e]) {  // (a prediction is never trusted blindly)
                seen[e] = 1;
                N->predicted.push_back(e);
            }
        }
    }
    // at most half the tier per prediction, so a wide batch's guesses cannot flush it
    const size_t cap = (size_t) std::max(1, ram->n_blocks() / 2);
    std::vector<int32_t> keys;
    for (int32_t e : N->predicted) {
        const int32_t key = N->moe_index * man.n_experts + e;
        if (N->policy->slot_of(e) < 0 && ram->policy().slot_of(key) < 0 && keys.size() < cap) {
            keys.push_back(key);
        }
    }
    if (keys.empty()) {
        return;
    }
    refresh_busy();  // so that the guesses' blocks avoid reads still running, which they would have to wait for
    ram->policy().step(keys, ram_plan, /*use=*/false);  // cannot fail: keys are distinct and fewer than the blocks
    const layer_layout & lay = *N->layout;
    for (size_t j = 0; j < keys.size(); ++j) {
        const int32_t b = ram_plan[j].slot;
        stats.ram_evictions += ram_plan[j].evicted >= 0;
        reclaim_block(b);
        ram->wait_copy(b);
        pf_unused[b] = 1;
        stats.prefetch_issued++;
        const int32_t e = keys[j] % man.n_experts;
        uint8_t * dst = ram->block(b);
        pf->submit(b, [this, &lay, e, dst] { read_block(lay, e, dst); });
        mark_busy(b);
    }
}

// A block whose prefetch read may still run is busy in the tier's policy: a demand miss, a spill or another guess
// then takes another block rather than wait for that read (a wrong guess is the tier's next victim, so without this
// the next layer's first RAM miss would often take the block of the guess still being read, and wait for it).
void expert_pack_provider::mark_busy(int32_t b) {
    ram->policy().set_busy(b, true);
    pf_busy.push_back(b);
}

// Blocks whose prefetch read has finished, been dropped or been collected are not busy any more.
void expert_pack_provider::refresh_busy() {
    size_t kept = 0;
    for (int32_t b : pf_busy) {
        if (pf->pending(b) && !pf->finished(b)) {
            pf_busy[kept++] = b;
        } else {
            ram->policy().set_busy(b, false);
        }
    }
    pf_busy.resize(kept);
}

// Drop block b's prefetch read if it has not started (counted as cancelled); false if there was none to drop.
bool expert_pack_provider::cancel_prefetch(int32_t b) {
    if (!pf->cancel(b)) {
        return false;
    }
    prefetch_dropped(b);
    return true;
}

// Block b's prefetch was dropped before its read started: the block is not busy (refresh_busy forgets it).
void expert_pack_provider::prefetch_dropped(int32_t b) {
    ram->policy().set_busy(b, false);
    if (pf_unused[b]) {
        stats.prefetch_cancelled++;
        pf_unused[b] = 0;
    }
}

// Before block b gets other content: a prefetch read not yet started is dropped, one already running is waited for
// (its content is discarded whatever the outcome), and a prefetched block never used counts as wasted.
void expert_pack_provider::reclaim_block(int32_t b) {
    if (!pf) {
        return;
    }
    if (pf->pending(b) && !cancel_prefetch(b)) {
        (void) wait_prefetch(b);
    }
    if (pf_unused[b]) {
        stats.prefetch_wasted++;
        pf_unused[b] = 0;
    }
}

// Wait for block b's prefetch read, running or finished (the queued ones are dropped, never waited for): its
// exception, null when it succeeded. The wait counts in prefetch_wait_ns; the block is not busy any more.
std::exception_ptr expert_pack_provider::wait_prefetch(int32_t b) {
    const auto t0 = clk::now();
    std::exception_ptr err = pf->wait(b);
    stats.prefetch_wait_ns += ns_since(t0);
    ram->policy().set_busy(b, false);
    return err;
}

// Spill (ram_tier_mode "spill"): an expert the device evicts in this group, whose block the tier no longer holds, is
// copied back from its slot into the tier when it is more popular than the tier's least valued block. A copy out of
// the device (tens of microseconds on PCIe) instead of a pack read (milliseconds) the next time it is selected: with
// it, the tier holds the popular experts the device has no room for, not only those read recently. Called after the
// tier's step for the group (its blocks are pinned) and before any copy into these slots, which the same copy stream
// (or a synchronous copy on the CPU) orders after the spill.
void expert_pack_provider::spill(expert_pack_layer * L, size_t g, size_t n, const std::vector<size_t> & miss) {
    const layer_layout & lay = *L->layout;
    for (size_t j = g; j < g + n; ++j) {
        const auto & a = L->plan[miss[j]];
        if (a.evicted < 0) {
            continue;
        }
        const int32_t key = L->moe_index * man.n_experts + a.evicted;
        int32_t old = -1;
        const int32_t b = ram->policy().admit(key, old);
        if (b < 0) {
            continue;  // already in the tier, or less popular than everything there
        }
        reclaim_block(b);
        ram->wait_copy(b);
        try {
            ram->copying(b, L->stage, L->stage->load_to(L->arena, a.slot, ram->block(b), lay.block_bytes));
        } catch (...) {
            ram->policy().invalidate(b);
            throw;
        }
        stats.ram_spills++;
        stats.ram_evictions += old >= 0;
    }
}

// At layer L's acquire, before it reads anything: every prefetch that has not started is dropped, needed or not.
// A needed one is then an ordinary miss, read by the read pool in parallel with L's other misses: waiting for the
// prefetch thread to work through its queue would serialise reads that read_threads can run side by side (on the
// H200, prefetch with 4 demand threads ran at 0.92x of the same tier without prefetch before this rule). So a
// prefetch only ever gains the time its read ran during the compute of the layers before. (A dropped guess emptied
// a block the tier valued least -- a spare copy of an expert on the device, or an unpopular one -- so putting its
// old expert back gains nothing: 0.01 RAM hits per token of 9.56 in scripts/prefetch_tier_check.py.)
// A running read is not waited for here: L's copy loop waits for one it needs only after submitting every read of
// its own (a running read L does not need is left to finish; reclaim_block waits for it before its block is reused).
void expert_pack_provider::settle_prefetches() {
    for (int32_t b : pf->cancel_queued()) {
        ram->policy().invalidate(b);  // the block holds nothing now
        prefetch_dropped(b);
    }
    refresh_busy();  // what is still busy now is a read that runs
}

// pack -> staging buffer -> slot. A staging buffer comes back after n_buffers() acquires, so miss j is submitted
// only once miss j - n_buffers() is in its slot (acquire then waits for that copy).
void expert_pack_provider::load_via_staging(miss_load & m) {
    expert_pack_layer * L = m.L;
    const layer_layout & lay = m.lay;
    std::vector<size_t> buf_of(m.miss.size());
    if (cfg.read_splits > 1 && lay.read_bytes >= 2 * PACK_ALIGNMENT) {
        // chunked: every chunk of the submitted misses in flight at once; each chunk is copied into its slot as it
        // lands (the slot is published only when acquire returns, after every block's checksum has passed)
        const uint64_t pages = lay.read_bytes / PACK_ALIGNMENT;
        const uint64_t per = (pages + (uint64_t) cfg.read_splits - 1) / (uint64_t) cfg.read_splits;
        m.chunk_bytes = per * PACK_ALIGNMENT;
        m.read_chunks = (size_t) ((lay.read_bytes + m.chunk_bytes - 1) / m.chunk_bytes);
        auto on_chunk = [&](size_t tag) {
            // the landed prefix not yet copied goes in one copy (fewer, larger copies than one per chunk)
            const size_t j = tag / m.read_chunks, c = tag % m.read_chunks;
            auto * b = m.blocks[j].get();
            b->collected[c] = 1;
            const bool last = --b->remaining == 0;
            size_t end = b->copied;
            while (end < m.read_chunks && b->collected[end]) ++end;
            if (end == b->copied) {
                return;  // an earlier chunk is still being read
            }
            const uint64_t off = b->copied * m.chunk_bytes;
            const uint64_t stop = std::min<uint64_t>(end * m.chunk_bytes, lay.block_bytes);
            b->copied = end;
            L->stage->store_part(L->arena, L->plan[m.miss[j]].slot, buf_of[j], off, stop > off ? stop - off : 0, last);
            if (last) {
                if (marks && j < marks->reads.size()) marks->reads[j].io = marks->reads[j].hash = step_timeline::now();
                stats.ram_misses++;
                m.loaded(j);
            }
        };
        stage_loop(m, buf_of, [&](size_t j, uint8_t * buf) { m.submit_chunked(j, buf); }, on_chunk);
        return;
    }
    auto on_read = [&](size_t j) {
        L->stage->store(L->arena, L->plan[m.miss[j]].slot, lay.block_bytes, buf_of[j]);  // asynchronous on a GPU
        stats.ram_misses++;
        m.loaded(j);
    };
    stage_loop(m, buf_of, [&](size_t j, uint8_t * buf) { m.submit_read(j, buf); }, on_read);
}

// The staging path's loop, whole blocks or chunks alike: miss `next` is submitted (into the staging buffer it gets)
// once miss next - n_buffers() is in its slot and no read is waiting to be collected; otherwise the next read is
// collected (on_done). After a failure nothing more is submitted and the reads in flight are drained.
template <class Submit, class OnDone>
void expert_pack_provider::stage_loop(miss_load & m, std::vector<size_t> & buf_of, const Submit & submit,
                                      const OnDone & on_done) {
    const size_t nb = m.L->stage->n_buffers();
    size_t next = 0;
    while ((!m.failure && next < m.miss.size()) || m.outstanding) {
        try {
            if (!m.failure && next < m.miss.size() && (next < nb || m.stored[next - nb]) && !reads->ready()) {
                const auto t0 = clk::now();
                uint8_t * buf = m.L->stage->acquire(&buf_of[next]);
                stats.copy_wait_ns += ns_since(t0);
                submit(next++, buf);
            } else {
                m.collect(on_done);
            }
        } catch (...) {
            if (!m.failure) m.failure = std::current_exception();
        }
    }
}

// RAM block -> slot; a RAM miss is first read from the pack into its block (each read has its own block). The
// misses go through the tier in groups of at most its block count (one policy step each, which pins the group's
// blocks); between groups every copy completes, so the next group may evict the previous one's blocks.
void expert_pack_provider::load_via_ram_tier(miss_load & m) {
    expert_pack_layer * L = m.L;
    const layer_layout & lay = m.lay;
    const size_t per_group = (size_t) ram->n_blocks();
    const bool victim_tier = cfg.ram_tier_mode == "victim";
    std::vector<int32_t> keys;
    for (size_t g = 0; g < m.miss.size() && !m.failure; g += per_group) {
        const size_t n = std::min(per_group, m.miss.size() - g);
        if (g > 0) {
            L->stage->finish();
        }
        keys.clear();
        for (size_t j = g; j < g + n; ++j) {
            keys.push_back(L->moe_index * man.n_experts + L->plan[m.miss[j]].expert);
        }
        if (victim_tier) {
            // the device just evicted these experts: their blocks (if still here) hold what the device does not
            for (size_t j = g; j < g + n; ++j) {
                const int32_t ev = L->plan[m.miss[j]].evicted;
                if (ev >= 0 && ram->policy().slot_of(L->moe_index * man.n_experts + ev) >= 0) {
                    ram->policy().promote(L->moe_index * man.n_experts + ev);
                }
            }
        }
        if (spill_tier) {
            // off the device now: their blocks rank by popularity again
            for (size_t j = g; j < g + n; ++j) {
                const int32_t ev = L->plan[m.miss[j]].evicted;
                if (ev >= 0) ram->policy().set_weight(L->moe_index * man.n_experts + ev, 1.0f);
            }
        }
        // cannot fail: n <= blocks, and the keys are distinct (spill: popularity was credited at round 0)
        ram->policy().step(keys, ram_plan, /*use=*/!spill_tier);
        if (spill_tier) {
            try {
                spill(L, g, n, m.miss);  // before any copy into those slots (same copy stream, or synchronous)
            } catch (...) {
                m.failure = std::current_exception();
            }
        }
        // A hit whose block a prefetch read is still writing goes last: every read of the group is submitted
        // before that read is waited for. If it failed, the block holds nothing and is read again here.
        std::vector<size_t> order, late;
        std::vector<char> reread(n, 0);
        for (size_t j = g; j < g + n; ++j) {
            const auto & r = ram_plan[j - g];
            (r.hit && pf && pf->pending(r.slot) ? late : order).push_back(j);
        }
        order.insert(order.end(), late.begin(), late.end());
        auto copy_out = [&](size_t j) {
            const auto & a = L->plan[m.miss[j]];
            const auto & r = ram_plan[j - g];
            const bool hit = r.hit && !reread[j - g];
            ram->order_after_copies(r.slot, L->stage);  // a spill into the block by another device's stream
            ram->copying(r.slot, L->stage, L->stage->store_from(L->arena, a.slot, ram->block(r.slot), lay.block_bytes));
            if (hit && pf && pf_unused[r.slot]) {
                stats.prefetch_used++;
                pf_unused[r.slot] = 0;
            }
            if (victim_tier) {
                ram->policy().demote(keys[j - g]);  // on the device now: this block is the tier's first to go
            } else if (spill_tier) {
                ram->policy().set_weight(keys[j - g], 0.0f);  // a spare copy while its expert is on the device
            }
            if (hit) {
                stats.ram_hits++;
            } else {
                stats.ram_misses++;
                stats.ram_evictions += !r.hit && r.evicted >= 0;
            }
            m.loaded(j);
        };
        size_t next = 0;
        while ((!m.failure && next < n) || m.outstanding) {
            try {
                if (!m.failure && next < n && !reads->ready()) {
                    const size_t j = order[next];
                    const auto & r = ram_plan[j - g];
                    if (r.hit && pf && pf->pending(r.slot)) {
                        if (m.outstanding && !pf->finished(r.slot)) {
                            m.collect(copy_out);  // copy what lands while the prefetch read runs
                            continue;
                        }
                        ++next;
                        if (wait_prefetch(r.slot)) {
                            stats.io_errors++;
                            pf_unused[r.slot] = 0;
                            reread[j - g] = 1;
                            m.submit_read(j, ram->block(r.slot));
                        } else {
                            copy_out(j);
                        }
                    } else if (r.hit) {
                        ++next;
                        copy_out(j);
                    } else {
                        reclaim_block(r.slot);   // nor one a prefetch read may still write
                        ram->wait_copy(r.slot);  // never overwrite a block whose copy may be in flight
                        ++next;
                        m.submit_read(j, ram->block(r.slot));
                    }
                } else {
                    m.collect(copy_out);
                }
            } catch (...) {
                if (!m.failure) m.failure = std::current_exception();
            }
        }
        if (m.failure) {
            // a block of this group that was to receive a read but did not reach its slot is not trusted
            for (size_t j = g; j < g + n; ++j) {
                if ((!ram_plan[j - g].hit || reread[j - g]) && !m.stored[j]) {
                    ram->policy().invalidate(ram_plan[j - g].slot);
                }
            }
        }
    }
}

// A round: the pairs it serves read their experts' slots (mask 1). Every other pair gets a zero input (mask 0),
// so its output is an exact zero whatever its slot holds. On the CPU those pairs read the all-zero slot: the
// served slots then see exactly the rows they see in stock llama.cpp, so the kernels tile them alike and the
// result is bit-identical. On a GPU a token's k slot ids must be distinct (mul_mat_id's id helper keeps one pair
// per token and expert; duplicates left rows unmapped and it read out of bounds): there each other pair reads a
// slot its token does not use, preferring the zero slot and slots outside this round.
void expert_pack_provider::map_round_slots(const expert_pack_layer * L, const std::vector<int32_t> & unique,
                                           const ggml_tensor * ids, int32_t * out, std::vector<float> * mask) const {
    const int64_t k = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];
    std::vector<char> in_round(man.n_experts, 0);
    for (int32_t e : unique) {
        in_round[e] = 1;
    }
    const bool distinct = L->arena.host_base == nullptr || test_distinct_slots;  // device memory (or the test seam)
    const int32_t n_arena = L->arena.n_slots;
    std::vector<int32_t> spare;  // slots for the other pairs on a GPU, best first
    if (distinct) {
        std::vector<char> served(n_arena, 0);
        for (int32_t e : unique) {
            served[L->policy->slot_of(e)] = 1;
        }
        if (L->zero_slot >= 0) spare.push_back(L->zero_slot);
        for (int32_t s = 0; s < n_arena; ++s) {
            if (!served[s] && s != L->zero_slot) spare.push_back(s);
        }
        for (int32_t s = 0; s < n_arena; ++s) {
            if (served[s]) spare.push_back(s);
        }
    }
    std::vector<char> used(n_arena, 0);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
        if (distinct) std::fill(used.begin(), used.end(), 0);
        for (int64_t j = 0; j < k; ++j) {
            if (in_round[row[j]]) {
                out[t * k + j] = L->policy->slot_of(row[j]);
                (*mask)[t * k + j] = 1.0f;
                if (distinct) used[out[t * k + j]] = 1;
            }
        }
        size_t next = 0;
        for (int64_t j = 0; j < k; ++j) {
            if (in_round[row[j]]) {
                continue;
            }
            if (!distinct) {
                out[t * k + j] = L->zero_slot;
                continue;
            }
            while (used[spare[next]]) ++next;  // k <= n_arena: a free one always exists
            out[t * k + j] = spare[next];
            used[spare[next]] = 1;
        }
    }
}

// Round 0 of a step: the distinct experts it needs, in first-use order, those already cached first (so that a
// round's group reuses the cache), into L->step_order; scores the prediction made for it, credits the tier's
// popularity, settles the prefetches, records the trace. False (the step failed) on an expert id out of range.
bool expert_pack_provider::order_step(expert_pack_layer * L, const ggml_tensor * ids) {
    const int64_t k = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];
    std::vector<int32_t> cached, missing;
    std::vector<char> seen(man.n_experts, 0);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = row[j];
            if (e < 0 || e >= man.n_experts) {
                fail_step("layer " + std::to_string(L->layout->layer) + ": router chose expert " +
                          std::to_string(e) + ", the pack has " + std::to_string(man.n_experts));
                return false;
            }
            if (!seen[e]) {
                seen[e] = 1;
                (L->policy->slot_of(e) >= 0 ? cached : missing).push_back(e);
            }
        }
    }
    if (!L->predicted.empty()) {  // how good was the prediction made for this step at the previous layer
        stats.predicted += L->predicted.size();
        for (int32_t e : L->predicted) {
            stats.predicted_correct += seen[e] != 0;
        }
        L->predicted.clear();
    }
    if (spill_tier) {  // the tier ranks by popularity: every selection counts, hit or miss
        for (int32_t e : cached) ram->policy().promote(L->moe_index * man.n_experts + e);
        for (int32_t e : missing) ram->policy().promote(L->moe_index * man.n_experts + e);
    }
    if (pf) {
        settle_prefetches();
    }
    L->step_order = std::move(cached);
    L->step_order.insert(L->step_order.end(), missing.begin(), missing.end());
    if (trace) {
        record_trace(*L->layout, ids);
    }
    return true;
}

void expert_pack_provider::acquire(expert_pack_layer * L, int32_t round, int32_t n_rounds, ggml_tensor * dst,
                                   std::vector<float> * mask) {
    const auto t_start = clk::now();
    struct timer {  // acquire_ns covers every return path
        counters & c; clk::time_point t0;
        ~timer() { c.acquire_ns += ns_since(t0); }
    } total{stats, t_start};
    const layer_layout & lay = *L->layout;
    const ggml_tensor * ids = dst->src[0];
    const int64_t k = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];
    int32_t * out = (int32_t *) dst->data;

    // a new graph compute starts where the layers wrap around (later rounds belong to their round 0's step)
    if (round == 0 && lay.layer <= last_layer) {
        timeline.new_step();
        step_failed = false;
        ++trace_step;
        if (spill_tier) {
            ram->policy().set_clock(trace_step);  // the tier's popularity decays per step, not per layer
        }
        acquired = true;
        count_step();
    }
    last_layer = lay.layer;
    marks = &timeline.begin_layer(lay.layer, round);
    struct end_mark {
        step_timeline::layer_marks *& m;
        ~end_mark() { if (m) m->end = step_timeline::now(); m = nullptr; }
    } em{marks};

    // A round's mask (1 for the pairs it serves) zeroes the input of every other pair: their outputs are exact zeros.
    if (mask) {
        mask->assign((size_t) (k * n_tokens), 0.0f);
    }
    // On failure every pair points at a valid slot, distinct within its token (the GPU's mul_mat_id assumes a
    // token's k ids are distinct; duplicates made it index out of bounds): the step is reported failed and its
    // outputs are unused.
    auto fill_failed = [&] {
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t j = 0; j < k; ++j) {
                out[t * k + j] = (int32_t) j;  // k <= slots: attach refuses a cache below one token's experts
            }
        }
    };
    if (step_failed || !L->policy) {
        if (!L->policy) fail_step("expert pack is not attached to a model");
        fill_failed();
        return;
    }

    // later rounds take their group from the order round 0 fixed
    if (round == 0 && !order_step(L, ids)) {
        fill_failed();
        return;
    }
    const size_t per_round = n_rounds == 1 ? L->step_order.size() : (size_t) L->policy->n_slots();
    const size_t begin = std::min(L->step_order.size(), (size_t) round * per_round);
    const std::vector<int32_t> unique(L->step_order.begin() + begin,
                                      L->step_order.begin() + std::min(L->step_order.size(), begin + per_round));
    if (n_rounds > 1 && round > 0 && !unique.empty()) {
        stats.fallback_count++;  // a step split into rounds (counted once per extra round with work)
    }

    if (!L->policy->step(unique, L->plan)) {
        fail_step("layer " + std::to_string(lay.layer) + ": this step needs " + std::to_string(unique.size()) +
                  " distinct experts, the cache holds " + std::to_string(L->policy->n_slots()) + " per layer");
        fill_failed();
        return;
    }

    miss_load m(*this, L);  // the device-cache misses, in plan order
    marks->plan = step_timeline::now();
    marks->reads.resize(m.miss.size());  // before any read is submitted: the read threads write into it
    const uint64_t hits = L->plan.size() - m.miss.size();
    if (ram) {
        load_via_ram_tier(m);
    } else {
        load_via_staging(m);
    }
    if (m.failure) {
        // nothing computed from missing data: every miss not in its slot holds no expert
        for (size_t j = 0; j < m.miss.size(); ++j) {
            if (!m.stored[j]) L->policy->invalidate(L->plan[m.miss[j]].slot);
        }
        L->stage->finish();  // staging buffers and RAM blocks are reused only after their copies
        stats.io_errors++;
        stats.cache_hits += hits;
        stats.cache_misses += m.misses;
        stats.cache_evictions += m.evictions;
        std::string msg = "unknown error while loading experts";
        try {
            std::rethrow_exception(m.failure);
        } catch (const std::exception & e) {
            msg = e.what();
        } catch (...) {
        }
        fail_step(msg);
        fill_failed();
        return;
    }
    const auto t_wait = clk::now();
    L->stage->finish();  // every copy complete before the slot ids reach the compute stream
    stats.copy_wait_ns += ns_since(t_wait);
    stats.cache_hits += hits;
    stats.cache_misses += m.misses;
    stats.cache_evictions += m.evictions;
    const uint64_t short_reads = io->retried_short_reads();
    stats.fallback_count += short_reads - counted_short_reads;
    counted_short_reads = short_reads;

    if (n_rounds == 1) {  // every pair is served
        for (int64_t t = 0; t < n_tokens; ++t) {
            const int32_t * row = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
            for (int64_t j = 0; j < k; ++j) {
                out[t * k + j] = L->policy->slot_of(row[j]);
            }
        }
        return;
    }
    map_round_slots(L, unique, ids, out, mask);
}

// ---- C API --------------------------------------------------------------------------------------------------

extern "C" int expert_pack_config_validate(const char * config_json, char * err, size_t err_len) {
    try {
        parse_config(config_json ? config_json : "");
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return -1;
    }
}

extern "C" expert_pack_provider * expert_pack_open(const char * config_json, char * err, size_t err_len) {
    try {
        auto p = std::make_unique<expert_pack_provider>();
        p->cfg = parse_config(config_json ? config_json : "");
        p->man = load_manifest(p->cfg.manifest_path);
        p->io = std::make_unique<io_engine>(p->cfg.pack_path, p->cfg.direct_io, p->cfg.read_splits);
        p->reads = std::make_unique<read_pool>(p->cfg.read_threads);
        {
            aligned_buffer header(PACK_HEADER_SIZE);
            p->io->read(header.ptr, 0, PACK_HEADER_SIZE);
            check_pack_header(header.ptr, p->io->file_size(), p->man);
        }
        for (const auto & l : p->man.layers) {
            p->max_read = std::max(p->max_read, l.read_bytes);
        }
        ggml_init_params ip = {ggml_tensor_overhead() * (p->man.layers.size() * 4 + 8), nullptr, true};
        p->meta_ctx = ggml_init(ip);
        for (const auto & l : p->man.layers) {
            auto L = std::make_unique<expert_pack_layer>();
            L->owner = p.get();
            L->layout = &l;
            L->moe_index = (int32_t) (&l - p->man.layers.data());
            L->meta.assign(l.roles.size(), nullptr);
            for (size_t r = 0; r < l.roles.size(); ++r) {
                p->by_tensor[l.roles[r].tensor] = {L.get(), r};
            }
            p->layers[l.layer] = std::move(L);
        }
        for (auto & [il, L] : p->layers) {
            auto it = p->layers.find(il + 1);
            L->next = it == p->layers.end() ? nullptr : it->second.get();
        }
        if (!p->cfg.stats_path.empty()) {  // likewise the stats file: written now (zero counters), then while running
            if (!write_file_atomic(p->cfg.stats_path, stats_json(p->stats.snapshot(), p->stats, p->geometry_json()))) {
                throw std::runtime_error("expert_pack key 'stats_path': cannot write " + p->cfg.stats_path + ": " +
                                         strerror(errno));
            }
        }
        if (!p->cfg.trace_path.empty()) {  // a path we cannot write is a start-up error, not a silent no-trace
            p->trace = fopen(p->cfg.trace_path.c_str(), "wb");
            if (!p->trace) {
                throw std::runtime_error("expert_pack key 'trace_path': cannot create " + p->cfg.trace_path + ": " +
                                         strerror(errno));
            }
        }
        return p.release();
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return nullptr;
    }
}

extern "C" void expert_pack_free(expert_pack_provider * p) {
    if (p) {
        p->flush_stats();
        delete p;
    }
}

extern "C" void expert_pack_get_stats(const expert_pack_provider * p, expert_pack_stats * out) {
    *out = p->stats.snapshot();
}

extern "C" void expert_pack_reset_stats(expert_pack_provider * p) {
    p->stats.reset();
}

extern "C" void expert_pack_reset_cache(expert_pack_provider * p) {
    for (auto & [_, l] : p->layers) {
        if (l->policy) l->policy->clear();
    }
    if (p->spill_tier) {  // no expert is on a device now: every block ranks by popularity
        for (int32_t key = 0; key < (int32_t) (p->man.layers.size() * p->man.n_experts); ++key) {
            p->ram->policy().set_weight(key, 1.0f);
        }
    }
}

extern "C" size_t expert_pack_stats_json(const expert_pack_provider * p, char * buf, size_t len) {
    const std::string s = stats_json(p->stats.snapshot(), p->stats, p->geometry_json());
    if (buf && len > s.size()) {
        memcpy(buf, s.c_str(), s.size() + 1);
    }
    return s.size();
}

extern "C" const char * expert_pack_last_error(const expert_pack_provider * p) {
    return p->last_error.c_str();
}

extern "C" int32_t expert_pack_slots_per_layer(const expert_pack_provider * p) {
    return p->slots_min;
}

extern "C" uint32_t expert_pack_max_ubatch(const expert_pack_provider * p) {
    return p->max_ubatch;
}

extern "C" size_t expert_pack_summary(const expert_pack_provider * p, char * buf, size_t len) {
    if (buf && len > p->summary.size()) {
        memcpy(buf, p->summary.c_str(), p->summary.size() + 1);
    }
    return p->summary.size();
}

extern "C" size_t expert_pack_timeline_json(const expert_pack_provider * p, char * buf, size_t len) {
    const std::string s = p->timeline.last_json();
    if (buf && len > s.size()) {
        memcpy(buf, s.c_str(), s.size() + 1);
    }
    return s.size();
}

extern "C" void expert_pack_step_done(expert_pack_provider * p, int64_t n_tokens) {
    if (!p->attached) {
        return;
    }
    if (p->n_resident > 0 && n_tokens > 0) {
        const int64_t per_layer = std::min<int64_t>(p->man.n_experts, (int64_t) p->n_expert_used * n_tokens);
        p->stats.cache_hits += (uint64_t) per_layer * p->n_resident;
    }
    if (!p->acquired) {
        p->count_step();
    }
    p->acquired = false;
}

// The model's hyperparameters that the pack depends on, before llama.cpp's loader reads them (it asserts on some
// values instead of refusing them): the architecture, the expert count, top-k, and every epsilon finite and > 0.
static void check_hparams(const gguf_context * g, const manifest & m, const char * path) {
    const std::string file(path);
    const int64_t ka = gguf_find_key(g, "general.architecture");
    if (ka < 0 || gguf_get_kv_type(g, ka) != GGUF_TYPE_STRING) {
        throw std::runtime_error(file + " has no general.architecture");
    }
    const std::string arch = gguf_get_val_str(g, ka);
    if (arch != m.arch) {
        throw std::runtime_error(file + " is a " + arch + " model, the pack holds the experts of a " + m.arch + " model");
    }
    auto get_u = [&](const std::string & key, int64_t & out) {
        const int64_t k = gguf_find_key(g, key.c_str());
        if (k < 0) return false;
        switch (gguf_get_kv_type(g, k)) {
            case GGUF_TYPE_UINT8:  out = gguf_get_val_u8(g, k); return true;
            case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, k); return true;
            case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, k); return true;
            case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, k); return true;
            case GGUF_TYPE_UINT64: out = (int64_t) std::min<uint64_t>(gguf_get_val_u64(g, k), INT64_MAX); return true;
            case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, k); return true;
            default: throw std::runtime_error(file + ": " + key + " is not an integer");
        }
    };
    int64_t n_expert = -1, n_used = -1, n_layer = -1;
    if (!get_u(arch + ".expert_count", n_expert) || n_expert != m.n_experts) {
        throw std::runtime_error(file + ": " + arch + ".expert_count is " + (n_expert < 0 ? "missing" : std::to_string(n_expert)) +
                                 ", the pack has " + std::to_string(m.n_experts) + " experts per layer");
    }
    if (!get_u(arch + ".expert_used_count", n_used) || n_used < 1 || n_used > n_expert) {
        throw std::runtime_error(file + ": " + arch + ".expert_used_count is " +
                                 (n_used < 0 ? std::string("missing") : std::to_string(n_used)) + " (must be 1.." +
                                 std::to_string(n_expert) + ")");
    }
    if (!get_u(arch + ".block_count", n_layer) || n_layer < 1 || n_layer > 512) {  // llama.cpp's LLAMA_MAX_LAYERS
        throw std::runtime_error(file + ": " + arch + ".block_count is " +
                                 (n_layer < 0 ? std::string("missing") : std::to_string(n_layer)) + " (must be 1..512)");
    }
    {
        for (const auto & l : m.layers) {
            if (l.layer >= n_layer) {
                throw std::runtime_error(file + ": " + arch + ".block_count is " + std::to_string(n_layer) +
                                         ", the pack has experts for layer " + std::to_string(l.layer));
            }
        }
    }
    for (int64_t k = 0; k < gguf_get_n_kv(g); ++k) {
        const std::string key = gguf_get_key(g, k);
        if (key.size() > 7 && key.compare(key.size() - 7, 7, "epsilon") == 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_FLOAT32) {
            const float v = gguf_get_val_f32(g, k);
            if (!std::isfinite(v) || v <= 0) {
                throw std::runtime_error(file + ": " + key + " is " + std::to_string(v) + " (must be finite and > 0)");
            }
        }
    }
}

// A pack's own trunk, cheaply: its size, tensor count and the checksum of its header and KV region recorded by the
// build (the full checksum is `expert-pack verify`'s). A trunk edited or damaged after the build is refused here
// instead of tripping an assertion in llama.cpp's loader.
static void check_trunk(const manifest & m, const char * path, size_t data_offset, int64_t n_tensors) {
    const std::string file(path);
    std::ifstream f(file, std::ios::binary | std::ios::ate);
    const uint64_t size = f ? (uint64_t) f.tellg() : 0;
    if (size != m.trunk_size) {
        throw std::runtime_error(file + " is " + std::to_string(size) + " bytes, the pack's manifest says " +
                                 std::to_string(m.trunk_size) + (size < m.trunk_size ? " (truncated)" : " (modified)") +
                                 ": rebuild the pack or restore its trunk");
    }
    if (n_tensors != m.trunk_n_tensors) {
        throw std::runtime_error(file + " holds " + std::to_string(n_tensors) + " tensors, the pack's manifest says " +
                                 std::to_string(m.trunk_n_tensors) + " (a modified trunk)");
    }
    if (m.trunk_header_checksum.empty()) {
        return;
    }
    if (data_offset != m.trunk_header_size) {
        throw std::runtime_error(file + ": its header ends at " + std::to_string(data_offset) + ", the manifest says " +
                                 std::to_string(m.trunk_header_size) + " (a modified trunk)");
    }
    std::vector<char> head(m.trunk_header_size);
    f.seekg(0);
    if (!f.read(head.data(), (std::streamsize) head.size())) {
        throw std::runtime_error("cannot read the header of " + file);
    }
    uint8_t d[16];
    expert_pack_xxh3_128(head.data(), head.size(), d);
    if (to_hex(d, 16) != m.trunk_header_checksum) {
        throw std::runtime_error(file + ": its header and metadata were modified after the build (checksum " +
                                 to_hex(d, 16) + ", the manifest records " + m.trunk_header_checksum + ")");
    }
}

// XXH3-128 over each shard's header bytes [0, data_offset) followed by its size (docs/FORMAT.md)
static std::string source_fingerprint(const std::vector<std::string> & paths) {
    expert_pack_hasher * h = expert_pack_hasher_new();
    std::string err;
    for (const auto & path : paths) {
        gguf_init_params ip = {true, nullptr};
        gguf_context * g = gguf_init_from_file(path.c_str(), ip);
        if (!g) {
            err = "cannot read the GGUF header of " + path;
            break;
        }
        const size_t off = gguf_get_data_offset(g);
        gguf_free(g);
        std::ifstream f(path, std::ios::binary | std::ios::ate);
        const uint64_t size = (uint64_t) f.tellg();
        std::vector<char> head(off);
        f.seekg(0);
        f.read(head.data(), (std::streamsize) off);
        expert_pack_hasher_update(h, head.data(), off);
        expert_pack_hasher_update(h, &size, 8);
    }
    uint8_t d[16];
    expert_pack_hasher_digest(h, d);
    expert_pack_hasher_free(h);
    if (!err.empty()) {
        throw std::runtime_error(err);
    }
    return to_hex(d, 16);
}

extern "C" int expert_pack_check_model(expert_pack_provider * p, const char * path, char * err, size_t err_len) {
    try {
        gguf_init_params ip = {true, nullptr};
        gguf_context * g = gguf_init_from_file(path, ip);
        if (!g) {
            throw std::runtime_error(std::string("cannot read ") + path + " as GGUF");
        }
        std::string trunk_id;
        uint16_t n_split = 1;
        std::string hparams_error;
        try {
            if (int64_t k = gguf_find_key(g, "expert_pack.pack_id"); k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_STRING) {
                trunk_id = gguf_get_val_str(g, k);
            }
            if (int64_t k = gguf_find_key(g, "split.count"); k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_UINT16) {
                n_split = gguf_get_val_u16(g, k);
            }
            check_hparams(g, p->man, path);
        } catch (const std::exception & e) {
            hparams_error = e.what();
        }
        const size_t data_offset = gguf_get_data_offset(g);
        const int64_t n_tensors = gguf_get_n_tensors(g);
        gguf_free(g);
        if (!trunk_id.empty()) {
            if (trunk_id != p->man.pack_id) {
                throw std::runtime_error(std::string(path) + " is the trunk of another pack (pack_id " + trunk_id +
                                         "; the expert pack is " + p->man.pack_id + ")");
            }
            if (!hparams_error.empty()) {  // the specific cause first; the checksum would only say "modified"
                throw std::runtime_error(hparams_error);
            }
            check_trunk(p->man, path, data_offset, n_tensors);
            return 0;
        }
        if (!hparams_error.empty()) {
            throw std::runtime_error(hparams_error);
        }
        std::vector<std::string> paths = {path};
        if (n_split > 1) {
            std::smatch mt;
            const std::string s(path);
            static const std::regex re("^(.*)-00001-of-(\\d{5})\\.gguf$");
            if (!std::regex_match(s, mt, re)) {
                throw std::runtime_error(s + " declares " + std::to_string(n_split) + " shards but is not the first one");
            }
            for (int i = 1; i < n_split; ++i) {
                char buf[32];
                snprintf(buf, sizeof(buf), "-%05d-of-%05d.gguf", i + 1, (int) n_split);
                paths.push_back(mt[1].str() + buf);
            }
        }
        const std::string fp = source_fingerprint(paths);
        if (fp != p->man.source_fingerprint) {
            throw std::runtime_error(std::string(path) + " is not the model this pack was built from (source fingerprint " +
                                     fp + ", the pack's is " + p->man.source_fingerprint + ")");
        }
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        std::lock_guard<std::mutex> lk(p->err_mu);
        p->last_error = e.what();
        return -1;
    }
}

extern "C" const char * expert_pack_id(const expert_pack_provider * p) {
    return p->man.pack_id.c_str();
}

extern "C" int expert_pack_has_tensor(const expert_pack_provider * p, const char * name) {
    return p->by_tensor.count(name) ? 1 : 0;
}

extern "C" ggml_tensor * expert_pack_tensor(expert_pack_provider * p, const char * name, int n_dims, const int64_t * ne,
                                            char * err, size_t err_len) {
    auto it = p->by_tensor.find(name);
    if (it == p->by_tensor.end()) {
        set_err(err, err_len, std::string(name) + " is not in the expert pack");
        return nullptr;
    }
    auto [L, r] = it->second;
    const role_layout & role = L->layout->roles[r];
    if (n_dims != 3 || ne[0] != role.ne[0] || ne[1] != role.ne[1] || ne[2] != role.ne[2]) {
        char buf[256];
        snprintf(buf, sizeof(buf), "%s: the model expects {%lld, %lld, %lld}, the pack holds {%lld, %lld, %lld}",
                 name, (long long) (n_dims > 0 ? ne[0] : 0), (long long) (n_dims > 1 ? ne[1] : 0),
                 (long long) (n_dims > 2 ? ne[2] : 0), (long long) role.ne[0], (long long) role.ne[1],
                 (long long) role.ne[2]);
        set_err(err, err_len, buf);
        return nullptr;
    }
    if (!L->meta[r]) {
        ggml_tensor * t = ggml_new_tensor_3d(p->meta_ctx, role.type, role.ne[0], role.ne[1], role.ne[2]);
        ggml_set_name(t, name);
        L->meta[r] = t;
        std::lock_guard<std::mutex> lk(g_registry_mu);
        g_registry[t] = L;
    }
    return L->meta[r];
}

extern "C" int expert_pack_attach(expert_pack_provider * p, int n_layer, ggml_backend_device * const * layer_devs,
                                  int n_expert_used, char * err, size_t err_len) {
    try {
        p->detach();
        p->n_expert_used = n_expert_used;
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        // the layers of each device share that device's budget, one slot count per device
        std::map<ggml_backend_dev_t, std::vector<expert_pack_layer *>> by_dev;
        for (auto & [il, L] : p->layers) {
            if (il >= n_layer) {
                throw std::runtime_error("the pack has experts for layer " + std::to_string(il) + ", the model has " +
                                         std::to_string(n_layer) + " layers (a pack of another model?)");
            }
            ggml_backend_dev_t dev = layer_devs && layer_devs[il] ? layer_devs[il] : cpu;
            by_dev[dev].push_back(L.get());
        }
        ggml_init_params ip = {ggml_tensor_overhead() * (p->layers.size() * 5 + 8), nullptr, true};
        p->arena_ctx = ggml_init(ip);
        const double MiB = 1024.0 * 1024.0;
        p->slots_min = INT32_MAX;
        std::string devices_summary;
        bool any_host_arena = false;
        for (auto & [dev, ls] : by_dev) {
            size_t free_mem = 0, total_mem = 0;
            std::string free_source = "free";
            const bool host = dev == cpu || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
            any_host_arena |= host;
            if (host) {
                // host memory: what the process can still take (MemAvailable, cgroup limits), not the machine's total
                const memory_headroom room = host_memory_headroom();
                if (room.bytes != UINT64_MAX) {
                    free_mem = (size_t) room.bytes;
                    free_source = room.source;
                }
            }
            if (free_mem == 0) {
                ggml_backend_dev_memory(dev, &free_mem, &total_mem);
                if (free_mem == 0 && total_mem == 0 && cpu) {
                    ggml_backend_dev_memory(cpu, &free_mem, &total_mem);
                }
            }
            const double reserve = p->cfg.cache_vram_reserve_mib * MiB;
            const double avail = std::max(0.0, (double) free_mem - reserve);
            const double budget = p->cfg.cache_vram_mib > 0 ? std::min(p->cfg.cache_vram_mib * MiB, avail) : avail;
            double per_slot = 0, fixed = 0;
            for (auto * L : ls) {
                per_slot += (double) slot_stride_for(*L->layout);
                fixed += (double) ARENA_TAIL_PAD;
            }
            // slots = floor(min(requested, free - reserve) / expert bytes), the same count in every layer
            // (the all-zero slot of a partial cache is counted as one more slot)
            int64_t slots = (int64_t) ((budget - fixed) / per_slot);
            if (slots < p->man.n_experts) {
                slots -= 1;
            }
            slots = std::min<int64_t>(slots, p->man.n_experts);
            if (slots < n_expert_used) {
                // the least budget that holds one token's experts (plus the all-zero slot unless that is every
                // expert), rounded up to the 0.1 MiB printed
                const int64_t need = n_expert_used < p->man.n_experts ? n_expert_used + 1 : n_expert_used;
                const double least_mib = std::ceil((per_slot * need + fixed) / MiB * 10) / 10;
                char buf[512];
                snprintf(buf, sizeof(buf),
                         "expert cache too small on %s: %.1f MiB (cache_vram_mib %.1f, %s %.0f MiB - reserve %.0f MiB) "
                         "holds %lld slot(s) per layer for %zu layers of %.2f MiB experts; one token needs %d experts "
                         "in each layer: at least %.1f MiB",
                         ggml_backend_dev_name(dev), budget / MiB, p->cfg.cache_vram_mib, free_source.c_str(),
                         free_mem / MiB, p->cfg.cache_vram_reserve_mib, (long long) std::max<int64_t>(slots, 0), ls.size(),
                         per_slot / ls.size() / MiB, n_expert_used, least_mib);
                throw std::runtime_error(buf);
            }
            ggml_backend_buffer_type_t buft = dev == cpu ? ggml_backend_cpu_buffer_type() : ggml_backend_dev_buffer_type(dev);
            p->stages.push_back(std::make_unique<staging>(dev, p->cfg.stage_slots, p->max_read));
            const bool all_fit = slots >= p->man.n_experts;
            for (auto * L : ls) {
                // a partial cache gets one extra, all-zero slot for rounds (inside the budget's tail padding)
                L->arena = alloc_arena(p->arena_ctx, buft, *L->layout, (int32_t) slots + (all_fit ? 0 : 1));
                L->zero_slot = all_fit ? -1 : (int32_t) slots;
                L->policy = std::make_unique<hybrid_policy>((int32_t) slots, p->man.n_experts);
                L->stage = p->stages.back().get();
                if (all_fit) {
                    p->preload(L);
                }
            }
            p->slots_min = std::min<int32_t>(p->slots_min, (int32_t) slots);
            uint64_t dev_bytes = 0;
            for (auto * L : ls) {
                dev_bytes += ggml_backend_buffer_get_size(L->arena.buffer);
            }
            char buf[512];
            snprintf(buf, sizeof(buf), "%s%s: %lld of %d experts x %zu layers = %.0f MiB (budget %s; %s %.0f MiB - "
                     "reserve %.0f MiB)", devices_summary.empty() ? "" : "; ", ggml_backend_dev_name(dev),
                     (long long) slots, p->man.n_experts, ls.size(), dev_bytes / MiB,
                     p->cfg.cache_vram_mib > 0 ? (std::to_string((long long) std::lround(p->cfg.cache_vram_mib)) +
                                                  " MiB asked").c_str() : "all that fits",
                     free_source.c_str(), free_mem / MiB, p->cfg.cache_vram_reserve_mib);
            devices_summary += buf;
        }
        // the host-RAM tier: one pool for all layers, blocks of the largest expert stride; only where some layer
        // can miss (resident layers never do)
        bool any_partial = false;
        for (auto & [_, L] : p->layers) {
            any_partial |= !L->resident;
        }
        uint64_t stride = 0;
        for (const auto & l : p->man.layers) {
            stride = std::max(stride, l.expert_stride);
        }
        double ram_mib = p->cfg.ram_cache_mib;
        std::string ram_how = "ram_cache_mib";
        if (ram_mib < 0) {
            // "auto": the sizing rule of docs/ARCHITECTURE.md with the process's own headroom as the limit: 80% of
            // what it can still take, less 4 GiB for the page cache and its later allocations (KV cache, compute
            // buffers); off when some MoE layer runs on the CPU (the cache itself is then host memory) or when every
            // layer is resident
            ram_mib = 0;
            ram_how = "auto";
            if (!any_host_arena && any_partial) {
                const memory_headroom room = host_memory_headroom();
                if (room.bytes != UINT64_MAX) {
                    ram_mib = std::max(0.0, 0.8 * (double) room.bytes / MiB - 4096.0);
                    ram_how = "auto: 80% of " + std::to_string((long long) (room.bytes / MiB)) + " MiB (" + room.source +
                              ") - 4096 MiB";
                }
            }
            if (ram_mib * MiB < (double) stride) {
                ram_mib = 0;
            }
        }
        if (ram_mib > 0 && any_partial) {
            const int64_t n_keys = (int64_t) p->man.layers.size() * p->man.n_experts;
            // more blocks than keys would never be used; the cap also keeps a huge value from overflowing
            const int64_t blocks = (int64_t) std::min<double>((double) n_keys, std::floor(ram_mib * MiB / stride));
            if (blocks < 1) {
                char buf[256];
                snprintf(buf, sizeof(buf), "expert_pack key 'ram_cache_mib' (%.3f) holds no expert block of %.2f MiB: "
                         "use at least %.2f, or 0 to turn the RAM tier off", ram_mib, stride / MiB, stride / MiB);
                throw std::runtime_error(buf);
            }
            // fail closed rather than swap or be OOM-killed later (pinned memory cannot be reclaimed, and counts
            // against a cgroup's memory.max)
            const memory_headroom room = host_memory_headroom();
            if ((uint64_t) blocks * stride > room.bytes) {
                char buf[512];
                snprintf(buf, sizeof(buf), "expert_pack key 'ram_cache_mib' asks for a host-RAM tier of %.1f MiB (%lld "
                         "blocks of %.2f MiB), but this process can take only %.1f MiB more (%s): lower it "
                         "(docs/ARCHITECTURE.md, \"Sizing the RAM tier\")", blocks * stride / MiB, (long long) blocks,
                         stride / MiB, room.bytes / MiB, room.source.c_str());
                throw std::runtime_error(buf);
            }
            ggml_backend_dev_t pin_dev = nullptr;  // pinned for the GPUs' copies when a GPU holds arenas
            for (auto & [dev, _] : by_dev) {
                if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                    pin_dev = dev;
                    break;
                }
            }
            p->spill_tier = p->cfg.ram_tier_mode == "spill";
            p->ram = std::make_unique<ram_tier>(pin_dev, (int32_t) blocks, stride, (int32_t) n_keys,
                                                p->spill_tier ? ram_tier::SPILL_HALF_LIFE : hybrid_policy::DEFAULT_HALF_LIFE);
            p->stats.ram_blocks = (uint64_t) blocks;
            p->stats.ram_bytes = p->ram->bytes();
            if (p->cfg.prefetch) {
                // one thread: a guess should be at most one read ahead of the demand reads it competes with (with 4,
                // more guesses had started before the next layer could drop them: 3.3x the wasted reads on the H200)
                p->pf = std::make_unique<prefetcher>(1);
                p->pf->hold(p->test_hold_prefetch);
                p->pf_unused.assign((size_t) blocks, 0);
            }
        }
        p->n_resident = 0;
        for (auto & [_, L] : p->layers) {
            p->n_resident += L->resident;
        }
        {
            char buf[256];
            if (p->ram) {
                snprintf(buf, sizeof(buf), "; host-RAM tier %.0f MiB (%lld blocks, %s, %s)", p->ram->bytes() / MiB,
                         (long long) p->stats.ram_blocks.load(), p->cfg.ram_tier_mode.c_str(), ram_how.c_str());
            } else {
                snprintf(buf, sizeof(buf), "; no host-RAM tier%s", ram_how == "ram_cache_mib" ? "" : " (auto: off)");
            }
            p->summary = "expert pack: " + std::to_string(p->slots_min) + " of " + std::to_string(p->man.n_experts) +
                         " experts cached per MoE layer, " + std::to_string(p->n_resident) + " of " +
                         std::to_string(p->layers.size()) + " MoE layers resident; " + devices_summary + buf;
        }
        if (p->trace && !p->trace_header) {
            // "EPTRACE1", u32 version, u32 n_layers, u32 n_experts, u32 k (docs/FORMAT.md)
            const uint32_t h[4] = {1, (uint32_t) p->man.layers.size(), (uint32_t) p->man.n_experts,
                                   (uint32_t) n_expert_used};
            if (fwrite("EPTRACE1", 1, 8, p->trace) != 8 || fwrite(h, sizeof(h), 1, p->trace) != 1) {
                throw std::runtime_error("expert_pack key 'trace_path': cannot write " + p->cfg.trace_path + ": " +
                                         strerror(errno));
            }
            p->trace_header = true;
        }
        // without rounds, one step's distinct experts in a layer (<= k * n_tokens) must fit the layer's slots
        p->max_ubatch = p->slots_min >= p->man.n_experts || p->rounds_allowed
                      ? 0 : (uint32_t) (p->slots_min / std::max(1, n_expert_used));
        p->attached = true;
        p->last_layer = INT32_MAX;
        return 0;
    } catch (const std::exception & e) {
        p->detach();
        set_err(err, err_len, e.what());
        std::lock_guard<std::mutex> lk(p->err_mu);
        p->last_error = e.what();  // llama.cpp only logs it; Python reads it here after a failed load
        return -1;
    }
}

extern "C" void expert_pack_detach(expert_pack_provider * p) {
    p->detach();
}

extern "C" expert_pack_layer * expert_pack_layer_of(const ggml_tensor * t) {
    std::lock_guard<std::mutex> lk(g_registry_mu);
    auto it = g_registry.find(t);
    return it == g_registry.end() ? nullptr : it->second;
}

extern "C" int expert_pack_layer_resident(const expert_pack_layer * l) {
    return l->resident ? 1 : 0;
}

extern "C" ggml_tensor * expert_pack_layer_arena(expert_pack_layer * l, const ggml_tensor * t) {
    for (size_t r = 0; r < l->meta.size(); ++r) {
        if (l->meta[r] == t) {
            return r < l->arena.roles.size() ? l->arena.roles[r] : nullptr;
        }
    }
    return nullptr;
}

extern "C" int32_t expert_pack_layer_rounds(expert_pack_layer * l, int64_t n_tokens) {
    const expert_pack_provider * p = l->owner;
    if (!l->policy || l->resident || !p->rounds_allowed) {
        return 1;
    }
    const int64_t needed = std::min<int64_t>(p->man.n_experts, (int64_t) p->n_expert_used * n_tokens);
    const int64_t slots = l->policy->n_slots();
    return (int32_t) std::max<int64_t>(1, (needed + slots - 1) / slots);
}

extern "C" void * expert_pack_layer_round(expert_pack_layer * l, int32_t round, int32_t n_rounds) {
    auto & r = l->rounds[{round, n_rounds}];
    if (!r) {
        r = std::make_unique<expert_pack_round>(expert_pack_round{l, round, n_rounds});
    }
    return r.get();
}

extern "C" void expert_pack_disable_rounds(expert_pack_provider * p) {
    p->rounds_allowed = false;
    if (p->attached) {
        p->max_ubatch = p->slots_min >= p->man.n_experts ? 0 : (uint32_t) (p->slots_min / std::max(1, p->n_expert_used));
    }
}

extern "C" void expert_pack_acquire(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {  // every CPU thread runs every node; one does the work, the others wait at the barrier
        return;
    }
    auto * r = (expert_pack_round *) userdata;
    r->layer->owner->acquire(r->layer, r->index, r->count, dst, r->count > 1 ? &r->mask : nullptr);
}

extern "C" void expert_pack_round_mask(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto * r = (const expert_pack_round *) userdata;
    float * out = (float *) dst->data;
    const size_t n = (size_t) ggml_nelements(dst);
    for (size_t i = 0; i < n; ++i) {
        out[i] = i < r->mask.size() ? r->mask[i] : 0.0f;  // a failed round serves nothing
    }
}

extern "C" void expert_pack_set_router(expert_pack_provider * p, int il, ggml_tensor * gate_inp, ggml_tensor * gate_inp_b,
                                       ggml_tensor * exp_probs_b) {
    auto it = p->layers.find(il);
    if (it == p->layers.end()) {
        return;
    }
    it->second->router = gate_inp;
    it->second->router_b = gate_inp_b;
    it->second->probs_b = exp_probs_b;
}

extern "C" expert_pack_layer * expert_pack_layer_prefetch_target(expert_pack_layer * l, ggml_tensor ** gate_inp,
                                                                ggml_tensor ** gate_inp_b, ggml_tensor ** exp_probs_b) {
    expert_pack_layer * n = l->next;
    if (!l->owner->pf || !n || !n->policy || n->resident || !n->router) {
        return nullptr;
    }
    *gate_inp = n->router;
    *gate_inp_b = n->router_b;
    *exp_probs_b = n->probs_b;
    return n;
}

extern "C" void expert_pack_prefetch(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * n = (expert_pack_layer *) userdata;
    n->owner->prefetch(n, dst->src[0]);
}

extern "C" void expert_pack_test_distinct_round_slots(expert_pack_provider * p, int on) {
    p->test_distinct_slots = on != 0;
}

extern "C" void expert_pack_test_hold_prefetch(expert_pack_provider * p, int on) {
    p->test_hold_prefetch = on != 0;
    if (p->pf) p->pf->hold(p->test_hold_prefetch);
}

extern "C" void expert_pack_test_inject_eio(expert_pack_provider * p, int64_t n) {
    p->io->inject_eio_after(n);
}

extern "C" int expert_pack_take_step_error(expert_pack_provider * p) {
    std::lock_guard<std::mutex> lk(p->err_mu);
    const bool f = p->failure_pending;
    p->failure_pending = false;
    return f ? 1 : 0;
}

// ---- the policy on its own ----------------------------------------------------------------------------------

struct expert_pack_policy {
    hybrid_policy policy;
    int32_t n_experts;
    std::vector<hybrid_policy::access> plan;
};

extern "C" expert_pack_policy * expert_pack_policy_new(int32_t n_slots, int32_t n_experts) {
    if (n_slots <= 0 || n_experts <= 0) {
        return nullptr;
    }
    return new expert_pack_policy{hybrid_policy(n_slots, n_experts), n_experts, {}};
}

extern "C" int expert_pack_policy_step(expert_pack_policy * pol, const int32_t * experts, int32_t n, int32_t * slots_out,
                                       uint64_t * hits, uint64_t * misses, uint64_t * evictions) {
    std::vector<int32_t> unique;
    std::vector<char> seen(pol->n_experts, 0);
    for (int32_t i = 0; i < n; ++i) {
        if (experts[i] < 0 || experts[i] >= pol->n_experts) {
            return -1;
        }
        if (!seen[experts[i]]) {
            seen[experts[i]] = 1;
            unique.push_back(experts[i]);
        }
    }
    if (!pol->policy.step(unique, pol->plan)) {
        return -1;
    }
    for (const auto & a : pol->plan) {
        *hits += a.hit;
        *misses += !a.hit;
        *evictions += !a.hit && a.evicted >= 0;
    }
    for (int32_t i = 0; i < n; ++i) {
        slots_out[i] = pol->policy.slot_of(experts[i]);
    }
    return 0;
}

extern "C" void expert_pack_policy_set_busy(expert_pack_policy * pol, int32_t slot, int busy) {
    if (slot >= 0 && slot < pol->policy.n_slots()) {
        pol->policy.set_busy(slot, busy != 0);
    }
}

extern "C" void expert_pack_policy_free(expert_pack_policy * pol) {
    delete pol;
}
