// The thread-pool I/O queue (config key read_threads): a step's misses are submitted as soon as each has a
// destination of its own (a RAM-tier block: all of them at once; a staging buffer: as many as there are buffers)
// and read by a few threads; the acquiring thread collects the reads in the order they land and starts each block's
// copy into its slot right away. With read_threads = 1 there are no threads: submit() runs the read on the caller,
// so the sequence is the plain read, copy, read, copy.
#pragma once

#include "io_queue.h"

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace expert_pack {

// Run fn; what it threw, or null (a read's failure travels to whoever collects the read).
inline std::exception_ptr run_catching(const std::function<void()> & fn) {
    try {
        fn();
    } catch (...) {
        return std::current_exception();
    }
    return nullptr;
}

class read_pool final : public io_queue {
public:
    read_pool(io_engine & io, counters & stats, int n_threads);  // n_threads <= 1: inline
    ~read_pool() override;
    read_pool(const read_pool &) = delete;
    read_pool & operator=(const read_pool &) = delete;

    void submit(size_t tag, read_request r) override;
    bool ready() override;
    std::pair<size_t, std::exception_ptr> next() override;

private:
    void worker();

    io_engine & io_;
    counters & stats_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable work_cv_, done_cv_;
    std::deque<std::pair<size_t, read_request>> jobs_;
    std::deque<std::pair<size_t, std::exception_ptr>> done_;
    std::atomic<size_t> n_done_{0};  // done_.size(), readable without the lock (next() spins on it briefly)
    bool stop_ = false;
    int spin_ = 0;  // pause iterations next() spins before it sleeps
};

}  // namespace expert_pack
