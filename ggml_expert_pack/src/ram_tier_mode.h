// What the host-RAM tier keeps (config key ram_tier_mode): how the device caches' loads and evictions feed the tier's
// policy. Each mode implements this interface; ram_tier_mode::make is the one place a mode is chosen. The provider
// calls the hooks at fixed points of a step and never asks which mode it runs.
//   spill      blocks rank by popularity over SPILL_HALF_LIFE steps (every selection counts, hit or miss); a block
//              whose expert is on a device is a spare copy and goes first; the device's popular victims are copied
//              back into the tier (the provider's spill, miss_load.cpp)
//   victim     a block whose expert went onto a device goes first; it comes back to the front when the device evicts it
//   inclusive  every block read, ranked as the device cache ranks (frequency/recency)
// (Replayed on a realistic trace, docs/ARCHITECTURE.md "The host-RAM tier": spill reads the least.)
#pragma once

#include "cache_policy.h"

#include <cstdint>
#include <memory>
#include <string>

namespace expert_pack {

class ram_tier_mode {
public:
    virtual ~ram_tier_mode() = default;
    static std::unique_ptr<ram_tier_mode> make(const std::string & name);  // a name config.cpp accepted

    virtual const char * name() const = 0;
    // the half-life of the tier policy's scores, in policy ticks
    virtual double half_life() const { return hybrid_policy::DEFAULT_HALF_LIFE; }
    // a new step (token) begins; `step` counts steps
    virtual void new_step(hybrid_policy & tier, uint64_t step) { (void) tier; (void) step; }
    // a step selected this key, before its layer loads anything (hit or miss on the device)
    virtual void selected(hybrid_policy & tier, int32_t key) { (void) tier; (void) key; }
    // a device cache evicted this key's expert to make room
    virtual void evicted_from_device(hybrid_policy & tier, int32_t key) { (void) tier; (void) key; }
    // whether a read into the tier counts as a use of its block (the policy's step `use`)
    virtual bool reads_are_uses() const { return true; }
    // whether the device's evicted experts are copied back into the tier (spill)
    virtual bool copies_back() const { return false; }
    // this key's block was copied into a device slot
    virtual void on_device(hybrid_policy & tier, int32_t key) { (void) tier; (void) key; }
    // every device cache was emptied (reset_cache): no key is on a device any more
    virtual void devices_cleared(hybrid_policy & tier, int32_t n_keys) { (void) tier; (void) n_keys; }
};

}  // namespace expert_pack
