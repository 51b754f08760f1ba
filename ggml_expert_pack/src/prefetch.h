// Background reads for next-layer prefetch (config key `prefetch`): while the device computes layer L, the
// experts that layer L+1's router is predicted to pick are read from the pack into host-RAM tier blocks by a few
// threads of their own. The provider decides what to read and where; this class only runs the reads, one per
// block, and lets the provider drop a read that has not started (the guess turned out wrong, or a demand read
// must go first) or wait for one that has.
//
// Demand first: the provider cancels every queued read before its next step reads anything, so a prefetch never
// sits in front of a demand miss; at most `threads` prefetch reads (the provider uses one) can still be running then.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace expert_pack {

class prefetcher {
public:
    explicit prefetcher(int n_threads);
    ~prefetcher();  // drops the queued reads and waits for the running ones
    prefetcher(const prefetcher &) = delete;
    prefetcher & operator=(const prefetcher &) = delete;

    // Read into block `block` (which has no read of this class pending) with `fn`.
    void submit(int32_t block, std::function<void()> fn);
    // Whether block has a read queued, running, or finished but not yet collected by wait().
    bool pending(int32_t block);
    // Whether block's read has finished (wait() then returns at once); false if none is pending.
    bool finished(int32_t block);
    // Drop block's read if it has not started; true if dropped (the block was never written).
    bool cancel(int32_t block);
    // Drop every read that has not started, at once (none starts in between); returns their blocks.
    std::vector<int32_t> cancel_queued();
    // Wait for block's read to finish and forget it: its exception, null when it succeeded. (The provider only
    // waits for running reads: it drops the queued ones first.)
    std::exception_ptr wait(int32_t block);
    // Test seam: while held, no queued read starts (so the provider drops every one of them).
    void hold(bool on);

private:
    void worker();

    enum class state { queued, running, done };
    struct job {
        state st = state::queued;
        std::function<void()> fn;
        std::exception_ptr err;
    };
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable work_cv_, done_cv_;
    std::deque<int32_t> queue_;                 // blocks whose read waits for a thread, oldest first
    std::unordered_map<int32_t, job> jobs_;     // every pending block
    bool stop_ = false;
    bool held_ = false;
};

}  // namespace expert_pack
