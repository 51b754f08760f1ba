// One step of one layer (the graph op expert_pack_acquire, the hot path): the step's distinct experts are planned
// against the layer's cache (cache_policy.h), its misses loaded into their slots (miss_load.cpp), and the slot ids
// handed back to the graph only when every copy is complete. Also: the next-layer prediction that feeds prefetch
// (prefetch_blocks.h), the routing trace, the counters' flushing, and the registry of packed tensors.
#include "provider.h"

#include "miss_load.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

using namespace expert_pack;
using clk = std::chrono::steady_clock;

namespace expert_pack {

namespace {
std::mutex g_registry_mu;
std::unordered_map<const ggml_tensor *, expert_pack_layer *> g_registry;
}  // namespace

void register_tensor(const ggml_tensor * t, expert_pack_layer * L) {
    std::lock_guard<std::mutex> lk(g_registry_mu);
    g_registry[t] = L;
}

void unregister_tensor(const ggml_tensor * t) {
    std::lock_guard<std::mutex> lk(g_registry_mu);
    g_registry.erase(t);
}

expert_pack_layer * layer_of_tensor(const ggml_tensor * t) {
    std::lock_guard<std::mutex> lk(g_registry_mu);
    auto it = g_registry.find(t);
    return it == g_registry.end() ? nullptr : it->second;
}

void expect_checksum(const layer_layout & lay, int32_t e, const uint8_t sum[16]) {
    if (memcmp(sum, lay.checksums[e].data(), 16) != 0) {
        throw io_error("checksum mismatch in layer " + std::to_string(lay.layer) + " expert " + std::to_string(e) +
                       " (pack offset " + std::to_string(lay.expert_offset(e)) + "): expected " +
                       to_hex(lay.checksums[e].data(), 16) + ", read " + to_hex(sum, 16));
    }
}

}  // namespace expert_pack

std::string expert_pack_provider::geometry_json() const {
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
    s += ",\"devices\":[";
    for (size_t i = 0; i < devices.size(); ++i) {
        s += (i ? "," : "") + devices[i]->to_json();
    }
    return s + "]";
}

void expert_pack_provider::flush_stats() {
    if (!cfg.stats_path.empty()) {
        write_file_atomic(cfg.stats_path, stats_json(stats.snapshot(), stats, geometry_json()));
    }
    if (trace) fflush(trace);
}

void expert_pack_provider::count_step() {
    const uint64_t step = ++stats.steps;
    if (!cfg.stats_path.empty() && step % (uint64_t) cfg.stats_flush_interval == 0) {
        flush_stats();
    }
}

void expert_pack_provider::count_cache(expert_pack_layer * L, uint64_t hits, uint64_t misses, uint64_t evictions) {
    stats.cache_hits += hits;
    stats.cache_misses += misses;
    stats.cache_evictions += evictions;
    if (L->dev_stats) {
        L->dev_stats->cache_hits += hits;
        L->dev_stats->cache_misses += misses;
        L->dev_stats->cache_evictions += evictions;
    }
}

void expert_pack_provider::fail_step(const std::string & msg) {
    std::lock_guard<std::mutex> lk(err_mu);
    last_error = msg;
    step_failed = true;
    failure_pending = true;
}

read_request expert_pack_provider::block_request(const layer_layout & lay, int32_t expert, uint8_t * dst,
                                                 step_timeline::read_marks * rm) {
    read_request r;
    r.dst = dst;
    r.offset = lay.expert_offset(expert);
    r.len = lay.read_bytes;
    r.marks = rm;
    if (cfg.verify_pack_sha256) {
        r.landed = [&lay, expert, dst] {
            uint8_t sum[16];
            expert_pack_xxh3_128(dst, lay.block_bytes, sum);
            expect_checksum(lay, expert, sum);
        };
    }
    return r;
}

void expert_pack_provider::read_block(const layer_layout & lay, int32_t expert, uint8_t * dst) {
    run_read(*io, stats, block_request(lay, expert, dst));
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
        if (L->dev_stats) L->dev_stats->h2d_bytes += lay.block_bytes;
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

// ---- next-layer prediction ---------------------------------------------------------------------------------
// At layer L the graph applies layer N = L + 1's router to L's router input and hands the top-k here, after L's
// acquire has loaded what L needs (demand first). The predicted experts that are neither on N's device nor in the
// RAM tier get RAM blocks and background reads (prefetch_blocks.h).
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
    pf->refresh_busy();  // so that the guesses' blocks avoid reads still running, which they would have to wait for
    ram->policy().step(keys, ram_plan, /*use=*/false);  // cannot fail: keys are distinct and fewer than the blocks
    const layer_layout & lay = *N->layout;
    for (size_t j = 0; j < keys.size(); ++j) {
        const int32_t b = ram_plan[j].slot;
        stats.ram_evictions += ram_plan[j].evicted >= 0;
        pf->reclaim(b);
        ram->wait_copy(b);
        const int32_t e = keys[j] % man.n_experts;
        uint8_t * dst = ram->block(b);
        pf->submit(b, [this, &lay, e, dst] { read_block(lay, e, dst); });
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
    const bool distinct = L->distinct_ids || test_distinct_slots;
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
    if (ram) {
        for (int32_t e : cached) ram_mode->selected(ram->policy(), L->moe_index * man.n_experts + e);
        for (int32_t e : missing) ram_mode->selected(ram->policy(), L->moe_index * man.n_experts + e);
    }
    if (pf) {
        pf->settle();
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
        if (ram) {
            ram_mode->new_step(ram->policy(), trace_step);
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
        count_cache(L, hits, m.misses, m.evictions);
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
    count_cache(L, hits, m.misses, m.evictions);
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
