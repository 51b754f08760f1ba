#include "cache_policy.h"

#include <cmath>

namespace expert_pack {

hybrid_policy::hybrid_policy(int32_t n_slots, int32_t n_experts, double half_life)
    : half_life_(half_life), weight_(n_experts, 1.0f), slot_of_(n_experts, -1), expert_in_(n_slots, -1),
      freq_(n_experts, 0.0), last_(n_experts, 0), pinned_(n_slots, 0), busy_(n_slots, 0), key_of_(n_slots) {
    for (int32_t s = 0; s < n_slots; ++s) {
        free_.insert(free_.end(), s);
    }
}

double hybrid_policy::score(int32_t e) const {
    return freq_[e] * std::exp2(-double(clock_ - last_[e]) / half_life_);
}

double hybrid_policy::unweighted_rank(int32_t e) const {
    if (freq_[e] <= 0) {
        return -INFINITY;  // never used (or demoted): below every used expert, ties go to the older use
    }
    return std::log2(freq_[e]) + double(last_[e]) / half_life_;
}

double hybrid_policy::rank(int32_t e) const {
    return weight_[e] > 0 ? unweighted_rank(e) + std::log2((double) weight_[e]) : -INFINITY;
}

void hybrid_policy::unindex(int32_t s) {
    order_.erase(key_of_[s]);
}

void hybrid_policy::reindex(int32_t s) {
    order_.erase(key_of_[s]);  // no-op for a slot that was free
    const int32_t e = expert_in_[s];
    key_of_[s] = key{rank(e), last_[e], s};
    order_.insert(key_of_[s]);
}

int32_t hybrid_policy::lowest_unpinned() const {
    for (int32_t s : free_) {  // a free slot beats any eviction
        if (pinned_[s] != now_) {
            return s;
        }
    }
    // at most the step's own experts are pinned and a few slots busy: this skips no more than those
    int32_t busy = -1;
    for (const key & k : order_) {
        const int32_t s = std::get<2>(k);
        if (pinned_[s] == now_) {
            continue;
        }
        if (!busy_[s]) {
            return s;
        }
        if (busy < 0) {
            busy = s;
        }
    }
    return busy;
}

bool hybrid_policy::step(const std::vector<int32_t> & unique, std::vector<access> & out, bool use) {
    if (unique.size() > expert_in_.size()) {
        return false;
    }
    ++now_;
    if (own_clock_) {
        clock_ = now_;
    }
    out.clear();
    out.reserve(unique.size());
    // hits first: every slot this step needs is pinned before any victim is chosen
    for (int32_t e : unique) {
        if (use) {
            freq_[e] = score(e) + 1.0;
            last_[e] = clock_;
        }
        const int32_t s = slot_of_[e];
        if (s >= 0) {
            pinned_[s] = now_;
            if (use) {
                reindex(s);
            }
        }
        out.push_back({e, s, s >= 0, -1});
    }
    for (auto & a : out) {
        if (a.hit) {
            continue;
        }
        const int32_t victim = lowest_unpinned();
        // cannot fail: at most n_slots experts are pinned and `a` is not one of them yet
        a.slot = victim;
        a.evicted = expert_in_[victim];
        if (a.evicted >= 0) {
            slot_of_[a.evicted] = -1;
        } else {
            free_.erase(victim);
        }
        expert_in_[victim] = a.expert;
        slot_of_[a.expert] = victim;
        pinned_[victim] = now_;
        reindex(victim);
    }
    return true;
}

void hybrid_policy::demote(int32_t e) {
    freq_[e] = 0.0;
    last_[e] = 0;
    if (slot_of_[e] >= 0) {
        reindex(slot_of_[e]);
    }
}

void hybrid_policy::promote(int32_t e) {
    freq_[e] = score(e) + 1.0;
    last_[e] = clock_;
    if (slot_of_[e] >= 0) {
        reindex(slot_of_[e]);
    }
}

void hybrid_policy::set_weight(int32_t e, float w) {
    weight_[e] = w;
    if (slot_of_[e] >= 0) {
        reindex(slot_of_[e]);
    }
}

int32_t hybrid_policy::admit(int32_t e, int32_t & evicted) {
    evicted = -1;
    if (slot_of_[e] >= 0) {
        return -1;
    }
    const int32_t s = lowest_unpinned();
    if (s < 0) {
        return -1;
    }
    const int32_t old = expert_in_[s];
    if (old >= 0) {
        if (!(unweighted_rank(e) > rank(old))) {
            return -1;
        }
        slot_of_[old] = -1;
        evicted = old;
    } else {
        free_.erase(s);
    }
    expert_in_[s] = e;
    slot_of_[e] = s;
    pinned_[s] = now_;
    reindex(s);
    return s;
}

void hybrid_policy::invalidate(int32_t slot) {
    const int32_t e = expert_in_[slot];
    if (e >= 0) {
        slot_of_[e] = -1;
        unindex(slot);
        free_.insert(slot);
    }
    expert_in_[slot] = -1;
}

void hybrid_policy::clear() {
    std::fill(slot_of_.begin(), slot_of_.end(), -1);
    std::fill(expert_in_.begin(), expert_in_.end(), -1);
    std::fill(freq_.begin(), freq_.end(), 0.0);
    std::fill(last_.begin(), last_.end(), 0);
    std::fill(pinned_.begin(), pinned_.end(), 0);
    std::fill(busy_.begin(), busy_.end(), 0);
    std::fill(weight_.begin(), weight_.end(), 1.0f);
    order_.clear();
    free_.clear();
    for (int32_t s = 0; s < n_slots(); ++s) {
        free_.insert(free_.end(), s);
    }
    now_ = 0;
    clock_ = 0;
}

}  // namespace expert_pack
