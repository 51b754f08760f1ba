#include "arena.h"

#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace expert_pack {

uint64_t slot_stride_for(const layer_layout & l) {
    uint64_t unit = 256;
    for (const auto & r : l.roles) {
        unit = std::lcm(unit, (uint64_t) ggml_type_size(r.type));
    }
    return (l.block_bytes + unit - 1) / unit * unit;
}

uint64_t arena_bytes(const layer_layout & l, int32_t n_slots) {
    return slot_stride_for(l) * (uint64_t) n_slots + ARENA_TAIL_PAD;
}

layer_arena alloc_arena(ggml_context * ctx, ggml_backend_buffer_type_t buft, const layer_layout & l, int32_t n_slots) {
    layer_arena a;
    a.n_slots = n_slots;
    a.slot_stride = slot_stride_for(l);
    const uint64_t size = arena_bytes(l, n_slots);
    a.buffer = ggml_backend_buft_alloc_buffer(buft, size);
    if (!a.buffer) {
        throw std::runtime_error("cannot allocate a " + std::to_string(size >> 20) + " MiB expert cache arena on " +
                                 ggml_backend_buft_name(buft) + " for layer " + std::to_string(l.layer));
    }
    ggml_backend_buffer_set_usage(a.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(a.buffer, 0);  // padding must read as zeros, never NaN (trap 4)
    uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(a.buffer);
    if (ggml_backend_buffer_is_host(a.buffer)) {
        a.host_base = base;
    }

    a.bytes = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) size);
    ggml_format_name(a.bytes, "expert_cache-%d", l.layer);
    if (ggml_backend_tensor_alloc(a.buffer, a.bytes, base) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("cannot place the expert cache arena of layer " + std::to_string(l.layer));
    }
    for (const auto & r : l.roles) {
        ggml_tensor * t = ggml_new_tensor_3d(ctx, r.type, r.ne[0], r.ne[1], n_slots);
        t->nb[2] = a.slot_stride;
        t->nb[3] = a.slot_stride * (uint64_t) n_slots;
        ggml_format_name(t, "expert_cache-%d.%s", l.layer, r.role.c_str());
        if (ggml_backend_tensor_alloc(a.buffer, t, base + r.offset) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("cannot place the " + r.role + " view of layer " + std::to_string(l.layer));
        }
        a.roles.push_back(t);
    }
    return a;
}

void free_arena(layer_arena & a) {
    if (a.buffer) {
        ggml_backend_buffer_free(a.buffer);
    }
    a = layer_arena();
}

void arena_store(layer_arena & a, int32_t slot, const void * block, size_t n) {
    const uint64_t off = (uint64_t) slot * a.slot_stride;
    if (a.host_base) {
        memcpy(a.host_base + off, block, n);
    } else {
        ggml_backend_tensor_set(a.bytes, block, off, n);
    }
}

void arena_load(const layer_arena & a, int32_t slot, void * block, size_t n) {
    const uint64_t off = (uint64_t) slot * a.slot_stride;
    if (a.host_base) {
        memcpy(block, a.host_base + off, n);
    } else {
        ggml_backend_tensor_get(a.bytes, block, off, n);
    }
}

}  // namespace expert_pack
