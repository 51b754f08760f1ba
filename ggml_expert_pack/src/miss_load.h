// The device-cache misses of one acquire on their way into their slots (from the pack through a staging buffer, or
// through the RAM tier: miss_load.cpp). Reads go to the I/O queue (read_threads; inline with 1) and are collected in
// the order they land; each landed block's copy into its slot starts at once. After the first failure nothing more
// is submitted or copied, and the reads still in flight are drained (they write into our buffers) before the load
// returns.
#pragma once

#include "provider.h"

#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace expert_pack {

struct miss_load {
    expert_pack_provider & p;
    expert_pack_layer * L;
    const layer_layout & lay;
    std::vector<size_t> miss;    // the plan's misses (indices into L->plan), in plan order
    std::vector<char> stored;    // miss j's expert is in its device slot
    uint64_t misses = 0, evictions = 0;
    std::exception_ptr failure;  // the first one
    size_t outstanding = 0;      // reads submitted and not yet collected

    // the chunked path (read_splits > 1 through staging): miss j is read_chunks requests of chunk_bytes, tag
    // j * read_chunks + c; the block's checksum advances chunk by chunk, in order, on whichever read thread holds the
    // next chunk, so it overlaps the reads of the later chunks
    struct chunked_block {
        std::mutex mu;
        std::vector<char> landed;
        size_t hashed = 0;        // chunks hashed so far, in order
        bool hashing = false;     // a read thread is hashing this block now
        expert_pack_hasher * h = nullptr;
        size_t remaining = 0;     // chunk requests not yet collected (acquiring thread only)
        std::vector<char> collected;  // chunks collected (acquiring thread only)
        size_t copied = 0;        // chunks whose copy into the slot is issued, in order (acquiring thread only)
        ~chunked_block() { if (h) expert_pack_hasher_free(h); }
    };
    size_t read_chunks = 1;
    uint64_t chunk_bytes = 0;
    std::vector<std::unique_ptr<chunked_block>> blocks;

    miss_load(expert_pack_provider & p, expert_pack_layer * L);

    // miss j's expert is in its slot (or its copy is queued on the copy stream, which finish() completes)
    void loaded(size_t j);

    // the next read to land: on_read(j) unless a read has failed
    template <class F> void collect(const F & on_read) {
        auto [j, err] = p.reads->next();
        --outstanding;
        if (err && !failure) failure = err;
        if (!failure) on_read(j);
    }

    void submit_read(size_t j, uint8_t * dst);     // miss j as one whole-block request
    void submit_chunked(size_t j, uint8_t * dst);  // miss j as read_chunks chunk requests

private:
    void chunk_landed(chunked_block * b, int32_t e, const uint8_t * dst, size_t c);
};

}  // namespace expert_pack
