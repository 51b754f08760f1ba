// Which cached expert to evict: a frequency/recency hybrid (LRFU). Each expert of a layer keeps a score that
// gains 1 per step it is used and halves every `half_life` steps, so a frequently used expert survives a
// short absence (LFU) while stale popularity fades (LRU). The policy never evicts an expert the current
// step needs and never writes anything back (caches hold read-only copies of the pack).
//
// The victim is found in O(log slots): every score decays by the same factor as the clock advances, so the order
// of the cached experts changes only when one of them is used, re-weighted or replaced. The slots are kept sorted
// by log2 of their priority at clock 0 (log2 freq + last / half_life + log2 weight); a scan of every slot per miss
// cost 5.3 ns per slot, 130 us per miss in a host-RAM tier of 25,000 blocks (scripts/policy_speed.py).
#pragma once

#include <cstdint>
#include <set>
#include <tuple>
#include <vector>

namespace expert_pack {

class hybrid_policy {
public:
    static constexpr double DEFAULT_HALF_LIFE = 16.0;  // steps

    hybrid_policy(int32_t n_slots, int32_t n_experts, double half_life = DEFAULT_HALF_LIFE);

    struct access {
        int32_t expert;
        int32_t slot;
        bool    hit;
        int32_t evicted;  // the expert this slot held before a miss, -1 if the slot was free
    };

    // One step: `unique` are the distinct experts the step needs. Fills `out` (same order) and returns true;
    // returns false, changing nothing, if they are more than the slots. With use = false (a prefetch: the experts
    // are only expected) they are placed and pinned for this step but gain no frequency or recency: a guess keeps
    // the score its expert already had, so a first-time guess is the next victim unless a real step uses it.
    bool step(const std::vector<int32_t> & unique, std::vector<access> & out, bool use = true);

    // A load failed: the slot holds nothing.
    void invalidate(int32_t slot);
    // A busy slot is still being written by a background read (the RAM tier: a running prefetch). Taking it would
    // wait for that read, so a victim is a busy slot only when every other unpinned slot is busy too.
    void set_busy(int32_t slot, bool busy) { busy_[slot] = busy; }
    // A cached expert is worth little for now (the host-RAM tier: its expert is on the device): the next victim.
    void demote(int32_t expert);
    // A cached expert is worth keeping again (the device evicted it): as if used now. Also how a caller that
    // keeps its own clock (set_clock) credits a use without a step.
    void promote(int32_t expert);
    // The RAM tier's ranking (mode "spill"): an expert's eviction priority is its score times its weight
    // (default 1; 0 while the expert is on the device, where its block is a spare copy). Scores are unchanged.
    void set_weight(int32_t expert, float w);
    // Decay scores by a clock the caller advances (the RAM tier: one tick per token step, so that its memory
    // does not shorten with the number of layers); without it, each step() is one tick.
    void set_clock(uint64_t t) { own_clock_ = false; clock_ = t; }
    // Place `expert` (not cached) in the slot of lowest priority that the current step has not pinned, if its
    // score beats that slot's priority (a free slot always loses). Pins the slot. Returns the slot, or -1 with
    // nothing changed; `evicted` gets the expert the slot held (-1 if free).
    int32_t admit(int32_t expert, int32_t & evicted);
    // Forget every cached expert (frequencies too).
    void clear();

    int32_t n_slots() const { return (int32_t) expert_in_.size(); }
    int32_t slot_of(int32_t expert) const { return slot_of_[expert]; }
    int32_t expert_in(int32_t slot) const { return expert_in_[slot]; }  // -1 if free

private:
    using key = std::tuple<double, uint64_t, int32_t>;  // (rank, last use, slot): the eviction order, lowest first

    double score(int32_t expert) const;     // frequency decayed to the clock
    double rank(int32_t expert) const;      // log2 of score x weight at clock 0: orders like them at any clock
    double unweighted_rank(int32_t expert) const;
    int32_t lowest_unpinned() const;        // -1 if every slot is pinned; a free slot first, a busy one last
    void reindex(int32_t slot);             // the slot's expert changed, or its rank did
    void unindex(int32_t slot);

    double half_life_;
    uint64_t now_ = 0;                // step counter (pinning)
    bool own_clock_ = true;
    uint64_t clock_ = 0;              // decay clock: now_ unless set_clock
    std::vector<float> weight_;       // per expert
    std::vector<int32_t> slot_of_;    // expert -> slot, -1 if not cached
    std::vector<int32_t> expert_in_;  // slot -> expert, -1 if free
    std::vector<double> freq_;        // per expert, kept while evicted: frequency outlives residency
    std::vector<uint64_t> last_;      // per expert: step of the last use
    std::vector<uint64_t> pinned_;    // per slot: the step that needs it (protection)
    std::vector<char> busy_;          // per slot: set_busy
    std::set<key> order_;             // the occupied slots, next victim first
    std::vector<key> key_of_;         // per occupied slot: its entry in order_
    std::set<int32_t> free_;          // the free slots, lowest first
};

}  // namespace expert_pack
