// Reads whole expert blocks from the pack: pread on an O_DIRECT descriptor (no page-cache copy) into
// 4096-aligned staging buffers, each block split into `read_splits` concurrent sub-reads. The buffered
// path (direct_io=false) exists for comparison only; a filesystem that refuses O_DIRECT is a start-up error,
// never a silent fallback.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace expert_pack {

struct io_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A storage emulator for benchmarks (test seam, off in the product): every request (a read, or each sub-read of a
// split read) waits a per-request latency, then its bytes pass a pipe of the given bandwidth shared by all
// requests, with at most `queue_depth` requests in flight, on top of the real read. Read from RAM-backed storage,
// this measures decode on a drive of that speed. Set by EXPERT_PACK_TEST_STORAGE="12GB/s,80us,32".
struct storage_emulator {
    double bytes_per_ns = 0;  // 0: off
    double latency_ns = 0;
    int queue_depth = 32;

    static storage_emulator from_env();  // throws std::runtime_error on a malformed value
    bool on() const { return bytes_per_ns > 0; }
};

class io_engine {
public:
    // Opens `path`; with `direct`, fails (std::runtime_error naming the cause) if the filesystem refuses O_DIRECT.
    io_engine(const std::string & path, bool direct, int read_splits);
    ~io_engine();

    io_engine(const io_engine &) = delete;
    io_engine & operator=(const io_engine &) = delete;

    // Read exactly `len` bytes at `off` into `dst` (4096-aligned address, offset and length when direct).
    // Throws io_error (short file, EIO, ...). Short reads are retried and counted.
    void read(void * dst, uint64_t off, size_t len);
    // The same as one request, never split (the caller splits: the chunked miss path of the provider).
    void read_whole(void * dst, uint64_t off, size_t len);

    uint64_t file_size() const { return size_; }

    // Test seam: after `n` more successful reads, reads fail with EIO (as a failing disk does); -1 disarms.
    void inject_eio_after(int64_t n) { eio_after_ = n; }
    bool direct() const { return direct_; }
    uint64_t retried_short_reads() const { return short_reads_.load(); }

    const storage_emulator & emulated() const { return emu_; }

private:
    void read_part(uint8_t * dst, uint64_t off, size_t len);
    void read_part_now(uint8_t * dst, uint64_t off, size_t len);
    int64_t emulate_begin(size_t len);  // the emulated drive takes a request: when it completes (steady ns)
    void emulate_end(int64_t done_at);  // ... waits until then and frees its queue slot
    void worker();

    std::string path_;
    int fd_ = -1;
    bool direct_ = false;
    int splits_ = 1;
    uint64_t size_ = 0;
    std::atomic<uint64_t> short_reads_{0};
    std::atomic<int64_t> eio_after_{-1};

    // sub-read workers (read_splits - 1 of them; the caller does one part itself)
    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::queue<std::function<void()>> jobs_;
    bool stop_ = false;

    storage_emulator emu_;
    std::mutex emu_mu_;
    std::condition_variable emu_cv_;
    int emu_in_flight_ = 0;
    int64_t emu_pipe_free_ns_ = 0;  // steady-clock time at which the emulated transfer pipe is free
};

}  // namespace expert_pack
