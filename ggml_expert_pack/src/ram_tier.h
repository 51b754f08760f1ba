// The host-RAM tier: one pool of whole expert blocks in host memory between the pack and the device caches,
// shared by every MoE layer, keyed by (MoE layer index, expert) = layer * n_experts + expert. A device-cache
// miss that hits here is copied from the block straight into the device slot (no disk read); a miss here is
// read from the pack (O_DIRECT) straight into a block (4096-aligned, so no staging copy), verified, then
// copied into the slot from there. On a GPU the blocks are page-locked (host_memory, fail closed), so the
// copies run asynchronously at full PCIe speed; on the CPU they are plain aligned memory.
//
// Eviction is the device cache's frequency/recency hybrid (cache_policy.h) over the keys; how the device's loads and
// evictions feed it is ram_tier_mode's choice (config.h). A block that the
// current acquire still needs is pinned by the policy's step; a block whose device copy may still be in
// flight is waited for before it is overwritten (each block remembers the ticket of its last copy).
#pragma once

#include "cache_policy.h"
#include "staging.h"

#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace expert_pack {

class ram_tier {
public:
    // n_blocks blocks of block_bytes (a multiple of 4096) for keys in [0, n_keys); pinned for `dev` when it is a
    // GPU device, plain aligned memory otherwise. Throws std::runtime_error naming the cause.
    // `half_life`: of the policy's scores (mode "spill" ranks by popularity over SPILL_HALF_LIFE steps).
    ram_tier(ggml_backend_dev_t dev, int32_t n_blocks, uint64_t block_bytes, int32_t n_keys,
             double half_life = hybrid_policy::DEFAULT_HALF_LIFE);

    // Popularity memory of mode "spill", in steps (tokens when decoding). Replayed on the realistic trace at a 10%
    // tier (scripts/ram_tier_sim.py --spill-half-life H; docs/results/policy/ram-tier-sim.md): 64 saves 19.5% of
    // the reads, 256 19.8%, unbounded 19.7%. Long memory wins on stable routing, and 256 still follows a change of
    // topic within a few hundred tokens.
    static constexpr double SPILL_HALF_LIFE = 256.0;

    int32_t n_blocks() const { return policy_.n_slots(); }
    uint64_t block_bytes() const { return block_bytes_; }
    uint64_t bytes() const { return block_bytes_ * (uint64_t) n_blocks(); }
    bool pinned() const { return mem_->pinned(); }

    // The policy over keys; its slots are the block indices.
    hybrid_policy & policy() { return policy_; }
    uint8_t * block(int32_t b) const { return mem_->base() + block_bytes_ * (uint64_t) b; }

    // Block b's content is being copied to a device by `s` (ticket from staging::store_from).
    void copying(int32_t b, staging * s, uint64_t ticket) { copies_[b] = {s, ticket}; }
    // Before block b is overwritten: wait for its last copy (a no-op when it is complete).
    void wait_copy(int32_t b);
    // Before `s` copies out of block b: its last copy, if queued on another stream (a spill into b from another
    // device), must be complete; one on `s` itself is ordered by the stream.
    void order_after_copies(int32_t b, const staging * s) {
        if (copies_[b].s && copies_[b].s != s) wait_copy(b);
    }

private:
    std::unique_ptr<host_memory> mem_;
    uint64_t block_bytes_;
    hybrid_policy policy_;
    struct copy { staging * s = nullptr; uint64_t ticket = 0; };
    std::vector<copy> copies_;
};

}  // namespace expert_pack
