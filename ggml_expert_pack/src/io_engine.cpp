#include "io_engine.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <future>
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

io_engine::io_engine(const std::string & path, bool direct, int read_splits)
    : path_(path), direct_(direct), splits_(read_splits < 1 ? 1 : read_splits) {
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
    // equal parts, each a multiple of 4096; the caller reads the first, the workers the others
    const size_t part = (len / splits_ + ALIGN - 1) / ALIGN * ALIGN;
    std::vector<std::future<void>> futs;
    for (size_t p = part; p < len; p += part) {
        auto task = std::make_shared<std::packaged_task<void()>>(
            [this, d, off, p, n = std::min(part, len - p)] { read_part(d + p, off + p, n); });
        futs.push_back(task->get_future());
        {
            std::lock_guard<std::mutex> lk(mu_);
            jobs_.emplace([task] { (*task)(); });
        }
        cv_.notify_one();
    }
    std::exception_ptr first;
    try {
        read_part(d, off, std::min(part, len));
    } catch (...) {
        first = std::current_exception();
    }
    for (auto & f : futs) {
        try {
            f.get();
        } catch (...) {
            if (!first) {
                first = std::current_exception();
            }
        }
    }
    if (first) {
        std::rethrow_exception(first);
    }
}

}  // namespace expert_pack
