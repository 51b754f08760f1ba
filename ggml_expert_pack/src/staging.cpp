#include "staging.h"

#include <cstring>

#include "manifest.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace expert_pack {

host_memory::host_memory(ggml_backend_dev_t dev, size_t bytes, const std::string & what, const std::string & knob) {
    const bool gpu = dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
    if (gpu) {
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);
        if (!host_buft) {
            throw std::runtime_error(std::string("device ") + ggml_backend_dev_name(dev) + " has no pinned host memory");
        }
        pinned_ = ggml_backend_buft_alloc_buffer(host_buft, bytes + PACK_ALIGNMENT);
        // ggml falls back to pageable memory when pinning fails: that buffer has another type
        if (!pinned_ || ggml_backend_buffer_get_type(pinned_) != host_buft) {
            if (pinned_) ggml_backend_buffer_free(pinned_);
            pinned_ = nullptr;
            throw std::runtime_error("cannot pin " + std::to_string(bytes >> 20) + " MiB of " + what + " for " +
                                     ggml_backend_dev_name(dev) + " (page-locking failed; check `ulimit -l` and free "
                                     "RAM, or lower " + knob + ")");
        }
        // only 32-byte alignment is promised: align ourselves (trap 8)
        base_ = (uint8_t *) ggml_backend_buffer_get_base(pinned_);
        base_ += (PACK_ALIGNMENT - (uintptr_t) base_ % PACK_ALIGNMENT) % PACK_ALIGNMENT;
    } else {
        if (posix_memalign(&plain_, PACK_ALIGNMENT, std::max<size_t>(bytes, 1)) != 0) {
            throw std::runtime_error("cannot allocate " + std::to_string(bytes >> 20) + " MiB of " + what +
                                     " (lower " + knob + ")");
        }
        base_ = (uint8_t *) plain_;
    }
    if ((uintptr_t) base_ % PACK_ALIGNMENT) {  // never read with O_DIRECT into a misaligned buffer
        throw std::runtime_error("misaligned " + what);
    }
}

host_memory::~host_memory() {
    if (pinned_) {
        ggml_backend_buffer_free(pinned_);
    }
    free(plain_);
}

staging::staging(ggml_backend_dev_t dev, int n, size_t bytes) : dev_(dev) {
    const size_t per = (bytes + PACK_ALIGNMENT - 1) / PACK_ALIGNMENT * PACK_ALIGNMENT;
    mem_ = std::make_unique<host_memory>(dev, per * n, "staging memory", "stage_slots");
    if (mem_->pinned()) {
        copy_backend_ = ggml_backend_dev_init(dev, nullptr);
        if (!copy_backend_) {
            throw std::runtime_error(std::string("cannot create a copy stream on ") + ggml_backend_dev_name(dev));
        }
        for (int i = 0; i < n; ++i) {
            ggml_backend_event_t ev = ggml_backend_event_new(dev);
            if (!ev) {
                throw std::runtime_error(std::string("device ") + ggml_backend_dev_name(dev) + " has no events");
            }
            events_.push_back(ev);
        }
    }
    for (int i = 0; i < n; ++i) {
        bufs_.push_back(mem_->base() + per * i);
    }
    in_flight_.assign(n, false);
}

staging::~staging() {
    if (copy_backend_) {
        ggml_backend_synchronize(copy_backend_);
    }
    for (auto * ev : events_) {
        ggml_backend_event_free(ev);
    }
    for (auto * ev : from_events_) {
        ggml_backend_event_free(ev);
    }
    if (copy_backend_) {
        ggml_backend_free(copy_backend_);
    }
}

uint8_t * staging::acquire(size_t * index) {
    cur_ = next_++ % bufs_.size();
    if (in_flight_[cur_]) {  // its last copy must be done before the buffer is overwritten
        ggml_backend_event_synchronize(events_[cur_]);
        in_flight_[cur_] = false;
    }
    if (index) {
        *index = cur_;
    }
    return bufs_[cur_];
}

void staging::store(layer_arena & arena, int32_t slot, size_t n) {
    store(arena, slot, n, cur_);
}

void staging::store(layer_arena & arena, int32_t slot, size_t n, size_t index) {
    const uint64_t off = (uint64_t) slot * arena.slot_stride;
    if (copy_backend_ && !arena.host_base) {
        ggml_backend_tensor_set_async(copy_backend_, arena.bytes, bufs_[index], off, n);
        ggml_backend_event_record(events_[index], copy_backend_);
        in_flight_[index] = true;
        pending_ = true;
    } else {
        arena_store(arena, slot, bufs_[index], n);
    }
}

void staging::store_part(layer_arena & arena, int32_t slot, size_t index, size_t off, size_t n, bool last) {
    const uint64_t dst = (uint64_t) slot * arena.slot_stride + off;
    if (copy_backend_ && !arena.host_base) {
        if (n) {
            ggml_backend_tensor_set_async(copy_backend_, arena.bytes, bufs_[index] + off, dst, n);
        }
        if (last) {
            ggml_backend_event_record(events_[index], copy_backend_);
            in_flight_[index] = true;
        }
        pending_ = true;
    } else if (!n) {
    } else if (arena.host_base) {
        memcpy(arena.host_base + dst, bufs_[index] + off, n);
    } else {
        ggml_backend_tensor_set(arena.bytes, bufs_[index] + off, dst, n);
    }
}

uint64_t staging::store_from(layer_arena & arena, int32_t slot, const uint8_t * src, size_t n) {
    const uint64_t off = (uint64_t) slot * arena.slot_stride;
    if (!copy_backend_ || arena.host_base) {
        arena_store(arena, slot, src, n);  // synchronous: complete on return
        return 0;
    }
    const size_t ev = next_event();
    ggml_backend_tensor_set_async(copy_backend_, arena.bytes, src, off, n);
    return ticket(ev);
}

uint64_t staging::load_to(const layer_arena & arena, int32_t slot, uint8_t * dst, size_t n) {
    const uint64_t off = (uint64_t) slot * arena.slot_stride;
    if (!copy_backend_ || arena.host_base) {
        arena_load(arena, slot, dst, n);  // synchronous: complete on return
        return 0;
    }
    const size_t ev = next_event();
    ggml_backend_tensor_get_async(copy_backend_, arena.bytes, dst, off, n);
    return ticket(ev);
}

size_t staging::next_event() {
    if (from_used_ == from_events_.size()) {
        ggml_backend_event_t ev = ggml_backend_event_new(dev_);
        if (!ev) {
            throw std::runtime_error(std::string("device ") + ggml_backend_dev_name(dev_) + " has no events");
        }
        from_events_.push_back(ev);
    }
    return from_used_++;
}

uint64_t staging::ticket(size_t i) {
    ggml_backend_event_record(from_events_[i], copy_backend_);
    pending_ = true;
    return ((uint64_t) epoch_ << 32) | (uint64_t) (i + 1);
}

void staging::wait(uint64_t ticket) {
    if (ticket == 0 || (uint32_t) (ticket >> 32) != epoch_) {
        return;  // synchronous, or issued before the last finish(), which waited for it
    }
    ggml_backend_event_synchronize(from_events_[(size_t) (ticket & 0xffffffffu) - 1]);
}

void staging::finish() {
    if (pending_) {
        ggml_backend_synchronize(copy_backend_);
        std::fill(in_flight_.begin(), in_flight_.end(), false);
        pending_ = false;
    }
    if (from_used_) {
        from_used_ = 0;
        ++epoch_;  // every earlier ticket is complete now
    }
}

}  // namespace expert_pack
