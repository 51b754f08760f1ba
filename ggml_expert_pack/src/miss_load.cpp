#include "miss_load.h"

#include <algorithm>
#include <cstring>

using namespace expert_pack;
using clk = std::chrono::steady_clock;

miss_load::miss_load(expert_pack_provider & p, expert_pack_layer * L) : p(p), L(L), lay(*L->layout) {
    for (size_t i = 0; i < L->plan.size(); ++i) {
        if (!L->plan[i].hit) miss.push_back(i);
    }
    stored.assign(miss.size(), 0);
}

void miss_load::loaded(size_t j) {
    if (p.marks && j < p.marks->reads.size()) p.marks->reads[j].copy = step_timeline::now();
    p.stats.h2d_bytes += lay.block_bytes;
    if (L->dev_stats) L->dev_stats->h2d_bytes += lay.block_bytes;
    ++misses;
    evictions += L->plan[miss[j]].evicted >= 0;
    stored[j] = 1;
}

void miss_load::submit_read(size_t j, uint8_t * dst) {
    const int32_t e = L->plan[miss[j]].expert;
    ++outstanding;
    step_timeline::read_marks * rm = nullptr;
    if (p.marks && j < p.marks->reads.size()) {
        rm = &p.marks->reads[j];
        rm->expert = e;
        rm->issue = step_timeline::now();
    }
    p.reads->submit(j, p.block_request(lay, e, dst, rm));
}

void miss_load::submit_chunked(size_t j, uint8_t * dst) {
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
        const uint64_t off = c * chunk_bytes;
        read_request r;
        r.dst = dst + off;
        r.offset = lay.expert_offset(e) + off;
        r.len = std::min<uint64_t>(chunk_bytes, lay.read_bytes - off);
        r.whole_block = false;
        if (b->h) r.landed = [this, b, e, dst, c] { chunk_landed(b, e, dst, c); };
        ++outstanding;
        p.reads->submit(j * read_chunks + c, std::move(r));
    }
}

void miss_load::chunk_landed(chunked_block * b, int32_t e, const uint8_t * dst, size_t c) {
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
    expect_checksum(lay, e, sum);
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

// Spill (the mode's copies_back): an expert the device evicts in this group, whose block the tier no longer holds, is
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

// RAM block -> slot; a RAM miss is first read from the pack into its block (each read has its own block). The
// misses go through the tier in groups of at most its block count (one policy step each, which pins the group's
// blocks); between groups every copy completes, so the next group may evict the previous one's blocks.
void expert_pack_provider::load_via_ram_tier(miss_load & m) {
    expert_pack_layer * L = m.L;
    const layer_layout & lay = m.lay;
    const size_t per_group = (size_t) ram->n_blocks();
    hybrid_policy & tier = ram->policy();
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
        for (size_t j = g; j < g + n; ++j) {
            const int32_t ev = L->plan[m.miss[j]].evicted;
            if (ev >= 0) ram_mode->evicted_from_device(tier, L->moe_index * man.n_experts + ev);
        }
        // cannot fail: n <= blocks, and the keys are distinct
        tier.step(keys, ram_plan, /*use=*/ram_mode->reads_are_uses());
        if (ram_mode->copies_back()) {
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
            if (hit && pf) {
                pf->used(r.slot);
            }
            ram_mode->on_device(tier, keys[j - g]);
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
                        if (pf->wait(r.slot)) {
                            stats.io_errors++;
                            pf->failed(r.slot);
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
                    tier.invalidate(ram_plan[j - g].slot);
                }
            }
        }
    }
}
