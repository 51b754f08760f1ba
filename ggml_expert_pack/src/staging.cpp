#include "staging.h"

#include "manifest.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace expert_pack {

staging::staging(ggml_backend_dev_t dev, int n, size_t bytes) {
    const size_t per = (bytes + PACK_ALIGNMENT - 1) / PACK_ALIGNMENT * PACK_ALIGNMENT;
    uint8_t * base = nullptr;
    const bool gpu = dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
    if (gpu) {
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);
        if (!host_buft) {
            throw std::runtime_error(std::string("device ") + ggml_backend_dev_name(dev) + " has no pinned host memory");
        }
        host_ = ggml_backend_buft_alloc_buffer(host_buft, per * n + PACK_ALIGNMENT);
        // ggml falls back to pageable memory when pinning fails: that buffer has another type
        if (!host_ || ggml_backend_buffer_get_type(host_) != host_buft) {
            if (host_) ggml_backend_buffer_free(host_);
            host_ = nullptr;
            throw std::runtime_error("cannot pin " + std::to_string((per * n) >> 20) + " MiB of staging memory for " +
                                     ggml_backend_dev_name(dev) + " (page-locking failed; check `ulimit -l` and free "
                                     "RAM, or lower stage_slots)");
        }
        // only 32-byte alignment is promised: align ourselves (trap 8)
        base = (uint8_t *) ggml_backend_buffer_get_base(host_);
        base += (PACK_ALIGNMENT - (uintptr_t) base % PACK_ALIGNMENT) % PACK_ALIGNMENT;
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
    } else {
        if (posix_memalign(&cpu_alloc_, PACK_ALIGNMENT, per * n) != 0) {
            throw std::runtime_error("cannot allocate " + std::to_string((per * n) >> 20) + " MiB of staging memory");
        }
        base = (uint8_t *) cpu_alloc_;
    }
    for (int i = 0; i < n; ++i) {
        bufs_.push_back(base + per * i);
        if ((uintptr_t) bufs_.back() % PACK_ALIGNMENT) {  // never read with O_DIRECT into a misaligned buffer
            throw std::runtime_error("misaligned staging buffer");
        }
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
    if (copy_backend_) {
        ggml_backend_free(copy_backend_);
    }
    if (host_) {
        ggml_backend_buffer_free(host_);
    }
    free(cpu_alloc_);
}

uint8_t * staging::acquire() {
    cur_ = next_++ % bufs_.size();
    if (in_flight_[cur_]) {  // its last copy must be done before the buffer is overwritten
        ggml_backend_event_synchronize(events_[cur_]);
        in_flight_[cur_] = false;
    }
    return bufs_[cur_];
}

void staging::store(layer_arena & arena, int32_t slot, size_t n) {
    const uint64_t off = (uint64_t) slot * arena.slot_stride;
    if (copy_backend_ && !arena.host_base) {
        ggml_backend_tensor_set_async(copy_backend_, arena.bytes, bufs_[cur_], off, n);
        ggml_backend_event_record(events_[cur_], copy_backend_);
        in_flight_[cur_] = true;
        pending_ = true;
    } else {
        arena_store(arena, slot, bufs_[cur_], n);
    }
}

void staging::finish() {
    if (pending_) {
        ggml_backend_synchronize(copy_backend_);
        std::fill(in_flight_.begin(), in_flight_.end(), false);
        pending_ = false;
    }
}

}  // namespace expert_pack
