#include "read_pool.h"

namespace expert_pack {

read_pool::read_pool(int n_threads) {
    for (int i = 0; n_threads > 1 && i < n_threads; ++i) {
        threads_.emplace_back([this] { worker(); });
    }
    // spin only where a core is left over for it (on a small machine it would slow the reads it waits for)
    spin_ = (int) std::thread::hardware_concurrency() > n_threads + 1 ? 2000 : 0;
}

read_pool::~read_pool() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    work_cv_.notify_all();
    for (auto & t : threads_) {
        t.join();
    }
}

void read_pool::submit(size_t tag, std::function<void()> fn) {
    if (threads_.empty()) {
        const std::exception_ptr err = run_catching(fn);
        std::lock_guard<std::mutex> lk(mu_);
        done_.emplace_back(tag, err);
        n_done_.fetch_add(1, std::memory_order_release);
        return;
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        jobs_.emplace_back(tag, std::move(fn));
    }
    work_cv_.notify_one();
}

bool read_pool::ready() {
    return n_done_.load(std::memory_order_acquire) > 0;
}

std::pair<size_t, std::exception_ptr> read_pool::next() {
    // a read of a chunk takes tens of microseconds on fast storage: spin a little before sleeping, since a wake-up
    // through the condition variable costs about as much
    for (int i = 0; i < spin_ && n_done_.load(std::memory_order_acquire) == 0; ++i) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return !done_.empty(); });
    auto d = done_.front();
    done_.pop_front();
    n_done_.fetch_sub(1, std::memory_order_relaxed);
    return d;
}

void read_pool::worker() {
    for (;;) {
        std::pair<size_t, std::function<void()>> job;
        {
            std::unique_lock<std::mutex> lk(mu_);
            work_cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
            if (stop_ && jobs_.empty()) {
                return;
            }
            job = std::move(jobs_.front());
            jobs_.pop_front();
        }
        const std::exception_ptr err = run_catching(job.second);
        {
            std::lock_guard<std::mutex> lk(mu_);
            done_.emplace_back(job.first, err);
            n_done_.fetch_add(1, std::memory_order_release);
        }
        done_cv_.notify_one();
    }
}

}  // namespace expert_pack
