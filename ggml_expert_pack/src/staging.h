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
#include <memory>
#include <string>
#include <vector>

namespace expert_pack {

// Host memory that pack reads land in and device copies start from: 4096-aligned (O_DIRECT); on a GPU device
// page-locked through the device's host buffer type and checked to be pinned (fail closed: a pageable
// fallback would make every copy synchronous and silently slow); plain memory otherwise. Shared by the
// staging buffers and the host-RAM tier (ram_tier.h).
class host_memory {
public:
    // `what` names the use in errors ("staging memory"), `knob` the key that sizes it ("stage_slots").
    host_memory(ggml_backend_dev_t dev, size_t bytes, const std::string & what, const std::string & knob);
    ~host_memory();
    host_memory(const host_memory &) = delete;
    host_memory & operator=(const host_memory &) = delete;

    uint8_t * base() const { return base_; }
    bool pinned() const { return pinned_ != nullptr; }

private:
    ggml_backend_buffer_t pinned_ = nullptr;  // GPU: the pinned allocation
    void * plain_ = nullptr;                  // CPU: one aligned allocation
    uint8_t * base_ = nullptr;
};

class staging {
public:
    // n buffers of `bytes` each for the arenas of `dev` (NULL or a CPU device: host memory, no copy stream).
    // Throws std::runtime_error naming the cause (pinned allocation failed, misaligned buffer, ...).
    staging(ggml_backend_dev_t dev, int n, size_t bytes);
    ~staging();
    staging(const staging &) = delete;
    staging & operator=(const staging &) = delete;

    // A free buffer for the next read (waits for its previous copy if still in flight). Buffers are handed out
    // round robin: a buffer comes back after n_buffers() more acquires. `index` (optional) names it for store().
    uint8_t * acquire(size_t * index = nullptr);
    // Copy `n` bytes of the buffer last returned by acquire() (or of buffer `index`) into a slot; asynchronous
    // on a GPU.
    void store(layer_arena & arena, int32_t slot, size_t n);
    void store(layer_arena & arena, int32_t slot, size_t n, size_t index);
    // Copy bytes [off, off + n) of buffer `index` into the same bytes of a slot (one chunk of a block); `last`: the
    // buffer's final copy, after which it may be reused (acquire waits for it). Asynchronous on a GPU.
    void store_part(layer_arena & arena, int32_t slot, size_t index, size_t off, size_t n, bool last);
    size_t n_buffers() const { return bufs_.size(); }
    // Copy `n` bytes from `src` into a slot without going through a staging buffer (the RAM tier's blocks).
    // On a GPU the copy is asynchronous, so `src` must be pinned memory that nobody overwrites until the copy
    // is complete: the returned ticket's wait(), or finish(), says when (0: already complete).
    uint64_t store_from(layer_arena & arena, int32_t slot, const uint8_t * src, size_t n);
    // Copy a slot's `n` bytes out into `dst` (pinned memory: a RAM-tier block), the other way. Queued on the same
    // stream as the copies into slots, so a later store into that slot, or store_from `dst`, runs after it; the
    // ticket says when `dst` holds the block (0: already).
    uint64_t load_to(const layer_arena & arena, int32_t slot, uint8_t * dst, size_t n);
    // Wait until the copy of `ticket` (from store_from or load_to) is complete; no-op when it already is.
    void wait(uint64_t ticket);
    // Wait until every copy issued since the last finish() is complete.
    void finish();

    bool pinned() const { return copy_backend_ != nullptr; }

private:
    size_t next_event();        // an event for the next queued copy (created on first use)
    uint64_t ticket(size_t ev);  // record it after that copy: the copy's ticket

    ggml_backend_dev_t dev_ = nullptr;
    ggml_backend_t copy_backend_ = nullptr;        // GPU: our own stream, separate from llama.cpp's compute stream
    std::unique_ptr<host_memory> mem_;
    std::vector<uint8_t *> bufs_;
    std::vector<ggml_backend_event_t> events_;
    std::vector<bool> in_flight_;
    size_t next_ = 0;
    size_t cur_ = 0;
    bool pending_ = false;
    // store_from's copies: one event each, reused after finish(); a ticket is (epoch << 32) | (index + 1), and
    // a ticket of an earlier epoch is complete (finish() waited for it)
    std::vector<ggml_backend_event_t> from_events_;
    size_t from_used_ = 0;
    uint32_t epoch_ = 1;
};

}  // namespace expert_pack
