// The I/O queue: where a step's pack reads go. A caller submits read requests (a whole expert block, or one chunk of
// one) and collects their completions in the order they land; each request's `landed` step (the block checksum)
// runs on the thread that completed the read, so no hash runs on the acquiring thread after a read. The thread
// pool (read_pool.h, read_threads) implements it; another engine (io_uring) implements the same three calls.
#pragma once

#include "io_engine.h"
#include "stats.h"
#include "timeline.h"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <utility>

namespace expert_pack {

struct read_request {
    uint8_t * dst = nullptr;   // 4096-aligned host memory (a staging buffer, a RAM-tier block)
    uint64_t offset = 0;       // in the pack
    uint64_t len = 0;
    bool whole_block = true;   // the engine may split it into read_splits sub-reads; a chunk is read as one request
    std::function<void()> landed;                 // after the bytes landed, on the completing thread; throws to fail
    step_timeline::read_marks * marks = nullptr;  // start / io / hash marks of the timeline (optional)
};

class io_queue {
public:
    virtual ~io_queue() = default;
    // Queue `r`; its completion is reported by next() under `tag`.
    virtual void submit(size_t tag, read_request r) = 0;
    // Whether a completion is waiting (next() would not block).
    virtual bool ready() = 0;
    // The next completed request, blocking until one is: its tag and its failure (null when it succeeded). Only call
    // with a request outstanding.
    virtual std::pair<size_t, std::exception_ptr> next() = 0;
};

// One request on the calling thread: the read (counted in read_ns and pack_read_bytes), the marks, then `landed`.
// Throws io_error. Every engine runs its requests through this, and so do the synchronous reads (preload, prefetch).
void run_read(io_engine & io, counters & stats, const read_request & r);

}  // namespace expert_pack
