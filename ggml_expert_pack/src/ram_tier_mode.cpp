#include "ram_tier_mode.h"

#include "ram_tier.h"

#include <stdexcept>

namespace expert_pack {

namespace {

class inclusive_mode final : public ram_tier_mode {
public:
    const char * name() const override { return "inclusive"; }
};

class victim_mode final : public ram_tier_mode {
public:
    const char * name() const override { return "victim"; }
    // the device just evicted it: its block (if still here) holds what the device does not
    void evicted_from_device(hybrid_policy & tier, int32_t key) override {
        if (tier.slot_of(key) >= 0) tier.promote(key);
    }
    // on the device now: this block is the tier's first to go
    void on_device(hybrid_policy & tier, int32_t key) override { tier.demote(key); }
};

class spill_mode final : public ram_tier_mode {
public:
    const char * name() const override { return "spill"; }
    double half_life() const override { return ram_tier::SPILL_HALF_LIFE; }
    // popularity decays per step, not per layer
    void new_step(hybrid_policy & tier, uint64_t step) override { tier.set_clock(step); }
    void selected(hybrid_policy & tier, int32_t key) override { tier.promote(key); }
    // off the device now: its block ranks by popularity again
    void evicted_from_device(hybrid_policy & tier, int32_t key) override { tier.set_weight(key, 1.0f); }
    // popularity was credited when the step selected the key
    bool reads_are_uses() const override { return false; }
    bool copies_back() const override { return true; }
    // a spare copy while its expert is on the device
    void on_device(hybrid_policy & tier, int32_t key) override { tier.set_weight(key, 0.0f); }
    void devices_cleared(hybrid_policy & tier, int32_t n_keys) override {
        for (int32_t key = 0; key < n_keys; ++key) tier.set_weight(key, 1.0f);
    }
};

}  // namespace

std::unique_ptr<ram_tier_mode> ram_tier_mode::make(const std::string & name) {
    if (name == "spill") return std::make_unique<spill_mode>();
    if (name == "victim") return std::make_unique<victim_mode>();
    if (name == "inclusive") return std::make_unique<inclusive_mode>();
    throw std::invalid_argument("unknown ram_tier_mode \"" + name + "\"");
}

}  // namespace expert_pack
