// Staging buffers between the pack and a device's cache arenas. On a GPU: page-locked (pinned) host memory,
// 4096-aligned for O_DIRECT, checked to really be pinned (ggml's host buffer type silently falls back to
// pageable memory; we fail closed instead), and a copy stream of our own: each miss is read into a free
// buffer and copied asynchronously into its slot; an event per buffer says when it may be reused, and
// finish() waits for every copy so that slots are published to the compute stream only once complete.
// On the CPU: plain aligned buffers and memcpy.
#pragma once

#include "arena.h"

#include "ggml-backend.h"

#include <cstdint>
#include <vector>

namespace expert_pack {

class staging {
public:
    // n buffers of `bytes` each for the arenas of `dev` (NULL or a CPU device: host memory, no copy stream).
    // Throws std::runtime_error naming the cause (pinned allocation failed, misaligned buffer, ...).
    staging(ggml_backend_dev_t dev, int n, size_t bytes);
    ~staging();
    staging(const staging &) = delete;
    staging & operator=(const staging &) = delete;

    // A free buffer for the next read (waits for its previous copy if still in flight).
    uint8_t * acquire();
    // Copy `n` bytes of the buffer last returned by acquire() into a slot; asynchronous on a GPU.
    void store(layer_arena & arena, int32_t slot, size_t n);
    // Wait until every copy issued since the last finish() is complete.
    void finish();

    bool pinned() const { return copy_backend_ != nullptr; }

private:
    ggml_backend_t copy_backend_ = nullptr;        // GPU: our own stream, separate from llama.cpp's compute stream
    ggml_backend_buffer_t host_ = nullptr;         // GPU: the pinned allocation
    std::vector<uint8_t *> bufs_;
    std::vector<ggml_backend_event_t> events_;
    std::vector<bool> in_flight_;
    size_t next_ = 0;
    size_t cur_ = 0;
    bool pending_ = false;
    void * cpu_alloc_ = nullptr;                   // CPU: one aligned allocation
};

}  // namespace expert_pack
