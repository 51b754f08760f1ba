#include "prefetch.h"

#include "read_pool.h"  // run_catching

#include <algorithm>

namespace expert_pack {

prefetcher::prefetcher(int n_threads) {
    for (int i = 0; i < std::max(1, n_threads); ++i) {
        threads_.emplace_back([this] { worker(); });
    }
}

prefetcher::~prefetcher() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
        for (int32_t b : queue_) {
            jobs_.erase(b);
        }
        queue_.clear();
    }
    work_cv_.notify_all();
    for (auto & t : threads_) {
        t.join();
    }
}

void prefetcher::submit(int32_t block, std::function<void()> fn) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        jobs_[block] = job{state::queued, std::move(fn), nullptr};
        queue_.push_back(block);
    }
    work_cv_.notify_one();
}

bool prefetcher::pending(int32_t block) {
    std::lock_guard<std::mutex> lk(mu_);
    return jobs_.count(block) != 0;
}

bool prefetcher::finished(int32_t block) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = jobs_.find(block);
    return it != jobs_.end() && it->second.st == state::done;
}

void prefetcher::hold(bool on) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        held_ = on;
    }
    work_cv_.notify_all();
}

bool prefetcher::cancel(int32_t block) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = jobs_.find(block);
    if (it == jobs_.end() || it->second.st != state::queued) {
        return false;
    }
    jobs_.erase(it);
    queue_.erase(std::find(queue_.begin(), queue_.end(), block));
    return true;
}

std::vector<int32_t> prefetcher::cancel_queued() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<int32_t> out(queue_.begin(), queue_.end());
    for (int32_t b : out) {
        jobs_.erase(b);
    }
    queue_.clear();
    return out;
}

std::exception_ptr prefetcher::wait(int32_t block) {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = jobs_.find(block);
    if (it == jobs_.end()) {
        return nullptr;
    }
    done_cv_.wait(lk, [&] { return jobs_.at(block).st == state::done; });
    it = jobs_.find(block);
    std::exception_ptr err = it->second.err;
    jobs_.erase(it);
    return err;
}

void prefetcher::worker() {
    for (;;) {
        int32_t block;
        std::function<void()> fn;
        {
            std::unique_lock<std::mutex> lk(mu_);
            work_cv_.wait(lk, [this] { return stop_ || (!queue_.empty() && !held_); });
            if (stop_ || queue_.empty()) {
                return;  // stopping
            }
            block = queue_.front();
            queue_.pop_front();
            job & j = jobs_.at(block);
            j.st = state::running;
            fn = std::move(j.fn);
        }
        const std::exception_ptr err = run_catching(fn);
        {
            std::lock_guard<std::mutex> lk(mu_);
            job & j = jobs_.at(block);
            j.st = state::done;
            j.err = err;
        }
        done_cv_.notify_all();
    }
}

}  // namespace expert_pack
