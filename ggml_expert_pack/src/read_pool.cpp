#include "read_pool.h"

namespace expert_pack {

void run_read(io_engine & io, counters & stats, const read_request & r) {
    struct hash_mark {  // set on failure too: the timeline shows where a failed read stopped
        step_timeline::read_marks * m;
        ~hash_mark() { if (m) m->hash = step_timeline::now(); }
    } hm{r.marks};
    const int64_t t0 = step_timeline::now();
    if (r.marks) r.marks->start = t0;
    if (r.whole_block) {
        io.read(r.dst, r.offset, r.len);
    } else {
        io.read_whole(r.dst, r.offset, r.len);
    }
    const int64_t t1 = step_timeline::now();
    stats.read_ns += (uint64_t) (t1 - t0);
    stats.pack_read_bytes += r.len;
    if (r.marks) r.marks->io = t1;
    if (r.landed) r.landed();
}

read_pool::read_pool(io_engine & io, counters & stats, int n_threads) : io_(io), stats_(stats) {
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

void read_pool::submit(size_t tag, read_request r) {
    if (threads_.empty()) {
        const std::exception_ptr err = run_catching([&] { run_read(io_, stats_, r); });
        std::lock_guard<std::mutex> lk(mu_);
        done_.emplace_back(tag, err);
        n_done_.fetch_add(1, std::memory_order_release);
        return;
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        jobs_.emplace_back(tag, std::move(r));
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
        std::pair<size_t, read_request> job;
        {
            std::unique_lock<std::mutex> lk(mu_);
            work_cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
            if (stop_ && jobs_.empty()) {
                return;
            }
            job = std::move(jobs_.front());
            jobs_.pop_front();
        }
        const std::exception_ptr err = run_catching([&] { run_read(io_, stats_, job.second); });
        {
            std::lock_guard<std::mutex> lk(mu_);
            done_.emplace_back(job.first, err);
            n_done_.fetch_add(1, std::memory_order_release);
        }
        done_cv_.notify_one();
    }
}

}  // namespace expert_pack
