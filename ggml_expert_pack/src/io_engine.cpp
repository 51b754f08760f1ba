#include "io_engine.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <exception>
#include <memory>
#include <sys/stat.h>
#include <unistd.h>

namespace expert_pack {

static constexpr size_t ALIGN = 4096;

// Test seam: EXPERT_PACK_TEST_REFUSE_ODIRECT=1 makes opening with O_DIRECT fail as a filesystem without
// O_DIRECT support does (EINVAL) -- this machine's tmpfs accepts O_DIRECT, so the refusal cannot be staged.
static bool test_refuse_odirect() {
    const char * v = getenv("EXPERT_PACK_TEST_REFUSE_ODIRECT");
    return v && *v && strcmp(v, "0") != 0;
}

storage_emulator storage_emulator::from_env() {
    storage_emulator e;
    const char * v = getenv("EXPERT_PACK_TEST_STORAGE");
    if (!v || !*v || strcmp(v, "0") == 0 || strcmp(v, "off") == 0) {
        return e;
    }
    double gbps = 0, lat_us = 0;
    int qd = 32;
    char u1[8] = {0}, u2[8] = {0};
    const int n = sscanf(v, "%lf%7[^,],%lf%7[^,],%d", &gbps, u1, &lat_us, u2, &qd);
    if (n < 4 || strcmp(u1, "GB/s") != 0 || strcmp(u2, "us") != 0 || gbps <= 0 || lat_us < 0 || qd < 1) {
        throw std::runtime_error(std::string("EXPERT_PACK_TEST_STORAGE=") + v +
                                 ": expected BANDWIDTH GB/s,LATENCY us[,QUEUE_DEPTH], e.g. 12GB/s,80us,32");
    }
    e.bytes_per_ns = gbps;  // 1 GB/s = 1 byte/ns
    e.latency_ns = lat_us * 1e3;
    e.queue_depth = qd;
    return e;
}

static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

int64_t io_engine::emulate_begin(size_t len) {
    std::unique_lock<std::mutex> lk(emu_mu_);
    emu_cv_.wait(lk, [this] { return emu_in_flight_ < emu_.queue_depth; });
    ++emu_in_flight_;
    // the request's latency, then its bytes through the shared pipe after those ahead of it
    const int64_t start = std::max(now_ns() + (int64_t) emu_.latency_ns, emu_pipe_free_ns_);
    const int64_t done_at = start + (int64_t) ((double) len / emu_.bytes_per_ns);
    emu_pipe_free_ns_ = done_at;
    return done_at;
}

void io_engine::emulate_end(int64_t done_at) {
    const int64_t wait = done_at - now_ns();
    if (wait > 0) {
        std::this_thread::sleep_for(std::chrono::nanoseconds(wait));
    }
    {
        std::lock_guard<std::mutex> lk(emu_mu_);
        --emu_in_flight_;
    }
    emu_cv_.notify_one();
}

io_engine::io_engine(const std::string & path, bool direct, int read_splits)
    : path_(path), direct_(direct), splits_(read_splits < 1 ? 1 : read_splits), emu_(storage_emulator::from_env()) {
    int flags = O_RDONLY | O_CLOEXEC;
    if (direct) {
        flags |= O_DIRECT;
    }
    if (direct && test_refuse_odirect()) {
        errno = EINVAL;
        fd_ = -1;
    } else {
        fd_ = ::open(path.c_str(), flags);
    }
    if (fd_ < 0) {
        const int e = errno;
        if (direct && e == EINVAL) {
            throw std::runtime_error("the filesystem holding " + path + " refuses O_DIRECT (EINVAL); direct_io is "
                                     "on and never falls back silently -- move the pack to a local filesystem "
                                     "or set direct_io=false (buffered reads, for comparison only)");
        }
        throw std::runtime_error("cannot open pack " + path + ": " + strerror(e));
    }
    struct stat st;
    if (fstat(fd_, &st) != 0) {
        const int e = errno;
        ::close(fd_);
        throw std::runtime_error("cannot stat pack " + path + ": " + strerror(e));
    }
    size_ = (uint64_t) st.st_size;
    if (direct) {
        // some filesystems accept the flag and fail the reads: prove one aligned read works now
        void * probe = nullptr;
        if (posix_memalign(&probe, ALIGN, ALIGN) != 0) {
            ::close(fd_);
            throw std::runtime_error("out of memory");
        }
        const ssize_t n = pread(fd_, probe, ALIGN, 0);
        const int e = errno;
        free(probe);
        if (n != (ssize_t) ALIGN) {
            ::close(fd_);
            throw std::runtime_error("O_DIRECT read of " + path + " failed (" + (n < 0 ? strerror(e) : "short read") +
                                     "); the filesystem does not support O_DIRECT reads");
        }
    } else {
        posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
    }
    for (int i = 1; i < splits_; ++i) {
        workers_.emplace_back([this] { worker(); });
    }
}

io_engine::~io_engine() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    for (auto & t : workers_) {
        t.join();
    }
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

void io_engine::worker() {
    for (;;) {
        std::function<void()> job;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
            if (stop_ && jobs_.empty()) {
                return;
            }
            job = std::move(jobs_.front());
            jobs_.pop();
        }
        job();
    }
}

void io_engine::read_part(uint8_t * dst, uint64_t off, size_t len) {
    if (emu_.on()) {
        // the real read (from RAM-backed storage) runs inside the emulated request's time, as a DMA would
        const int64_t done_at = emulate_begin(len);
        struct end_request {
            io_engine * e; int64_t t;
            ~end_request() { e->emulate_end(t); }
        } end{this, done_at};
        read_part_now(dst, off, len);
        return;
    }
    read_part_now(dst, off, len);
}

void io_engine::read_part_now(uint8_t * dst, uint64_t off, size_t len) {
    size_t done = 0;
    while (done < len) {
        const ssize_t n = pread(fd_, dst + done, len - done, (off_t) (off + done));
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            throw io_error("read of " + std::to_string(len) + " bytes at offset " + std::to_string(off) + " of " +
                           path_ + " failed: " + strerror(errno));
        }
        if (n == 0) {
            throw io_error("pack " + path_ + " ends at offset " + std::to_string(off + done) + ", expected data up to " +
                           std::to_string(off + len) + " (truncated?)");
        }
        done += (size_t) n;
        if (done < len) {
            short_reads_++;
        }
    }
}

void io_engine::read_whole(void * dst, uint64_t off, size_t len) {
    if (eio_after_.load() >= 0 && eio_after_.fetch_sub(1) <= 0) {
        eio_after_ = 0;
        throw io_error("read of " + std::to_string(len) + " bytes at offset " + std::to_string(off) + " of " + path_ +
                       " failed: Input/output error (injected)");
    }
    if (direct_ && (((uintptr_t) dst % ALIGN) || (off % ALIGN) || (len % ALIGN))) {
        throw io_error("misaligned O_DIRECT read (buffer, offset or length not a multiple of 4096)");
    }
    read_part((uint8_t *) dst, off, len);
}

void io_engine::read(void * dst, uint64_t off, size_t len) {
    uint8_t * d = (uint8_t *) dst;
    if (eio_after_.load() >= 0 && eio_after_.fetch_sub(1) <= 0) {
        eio_after_ = 0;  // stays failing until disarmed
        throw io_error("read of " + std::to_string(len) + " bytes at offset " + std::to_string(off) + " of " + path_ +
                       " failed: Input/output error (injected)");
    }
    if (direct_ && (((uintptr_t) d % ALIGN) || (off % ALIGN) || (len % ALIGN))) {
        throw io_error("misaligned O_DIRECT read (buffer, offset or length not a multiple of 4096)");
    }
    if (splits_ <= 1 || len < (size_t) splits_ * ALIGN) {
        read_part(d, off, len);
        return;
    }
    // equal parts, each a multiple of 4096; the caller reads the first, the workers the others. The join is a
    // plain counter under a mutex: std::future's shared state goes through std::call_once, which crashed
    // (SIGSEGV in llama_decode) where the toolchain links a private static libstdc++ into each shared library.
    const size_t part = (len / splits_ + ALIGN - 1) / ALIGN * ALIGN;
    struct join_state {
        std::mutex mu;
        std::condition_variable cv;
        size_t pending = 0;
        std::exception_ptr first;
        void done(std::exception_ptr err) {
            std::lock_guard<std::mutex> lk(mu);
            if (err && !first) first = err;
            if (--pending == 0) cv.notify_all();
        }
    };
    auto js = std::make_shared<join_state>();
    for (size_t p = part; p < len; p += part) {
        {
            std::lock_guard<std::mutex> lk(js->mu);
            ++js->pending;
        }
        {
            std::lock_guard<std::mutex> lk(mu_);
            jobs_.emplace([this, js, d, off, p, n = std::min(part, len - p)] {
                std::exception_ptr err;
                try {
                    read_part(d + p, off + p, n);
                } catch (...) {
                    err = std::current_exception();
                }
                js->done(err);
            });
        }
        cv_.notify_one();
    }
    std::exception_ptr mine;
    try {
        read_part(d, off, std::min(part, len));
    } catch (...) {
        mine = std::current_exception();
    }
    std::unique_lock<std::mutex> lk(js->mu);
    js->cv.wait(lk, [&] { return js->pending == 0; });
    if (mine) {
        std::rethrow_exception(mine);
    }
    if (js->first) {
        std::rethrow_exception(js->first);
    }
}

}  // namespace expert_pack
