// The per-layer timeline of one step, from the provider's own clock: when each layer's acquire began (its router's
// ids reached the host), when its plan was made, when each miss was submitted, started reading, finished reading,
// finished its checksum and had its copy queued, when the copies were complete and the slot ids went back. The gap
// between one layer's end and the next one's start is the device's work in between (the experts' matmuls, the next
// attention and router, the ids' trip to the host). Kept for the last complete step; benchmarks print it
// (expert_pack_timeline_json) to see what serialises.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace expert_pack {

class step_timeline {
public:
    struct read_marks {  // steady-clock ns; 0 = did not happen
        int32_t expert = -1;
        int64_t issue = 0, start = 0, io = 0, hash = 0, copy = 0;
    };
    struct layer_marks {
        int32_t layer = 0, round = 0;
        int64_t start = 0, plan = 0, end = 0;
        std::vector<read_marks> reads;
    };

    static int64_t now() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch()).count();
    }

    // a new step starts: the one before (if any) becomes the last complete step
    void new_step();
    // the step's graph compute returned (llama.cpp's decode, after its last layer): the device work after the last
    // acquire, and, from one step's end to the next one's first acquire, the host's time between decodes plus the
    // device's work before the first MoE layer
    void step_done() { done_ = now(); }
    // layer `layer` (round `round`) starts acquiring now; its marks (valid until the next begin_layer)
    layer_marks & begin_layer(int32_t layer, int32_t round);
    // the last complete step as JSON: {"prev_done_us", "done_us", "layers": [{"layer", "round", "start_us", "plan_us",
    // "end_us", "reads": [{"expert", "issue_us", "start_us", "io_us", "hash_us", "copy_us"}]}]}, times from its first
    // start (prev_done_us: the step before's step_done, negative; -1 where unknown)
    std::string last_json() const;

private:
    std::vector<layer_marks> cur_, last_;
    int64_t done_ = 0, prev_done_ = 0;            // the current step's step_done, the one before's
    int64_t last_done_ = 0, last_prev_done_ = 0;  // the same for the last complete step
    mutable std::mutex mu_;  // last_ is read by another thread (a stats reader)
};

}  // namespace expert_pack
