// Cache arenas: one per MoE layer, on the device that runs the layer. A slot holds one expert block in the
// pack's own layout, so a miss is a single copy; per role, a mul_mat_id view over all slots (ne[2] = slots).
#pragma once

#include "manifest.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <vector>

namespace expert_pack {

struct layer_arena {
    ggml_backend_buffer_t buffer = nullptr;
    ggml_tensor * bytes = nullptr;         // the whole arena as I8: copies into slots go through it
    std::vector<ggml_tensor *> roles;      // mul_mat_id views, in the layout's role order
    int32_t n_slots = 0;
    uint64_t slot_stride = 0;
    uint8_t * host_base = nullptr;         // set when the buffer is host memory (plain memcpy)
};

// Slot stride: the block rounded up so that every role view's nb[2] is a multiple of its type's block size
// and of 256 (docs/ARCHITECTURE.md, trap 3: kernels keep their fast paths and compute offsets in whole blocks).
uint64_t slot_stride_for(const layer_layout & l);

// Tail padding after the last slot: quantized GPU kernels read past the last row (docs/ARCHITECTURE.md, trap 4).
constexpr uint64_t ARENA_TAIL_PAD = 64 * 1024;

uint64_t arena_bytes(const layer_layout & l, int32_t n_slots);

// Allocate and zero an arena of n_slots on `buft`; the buffer is flagged WEIGHTS so the scheduler runs the
// layer's mul_mat_id where the arena lives. Tensors are created in `ctx` (no_alloc). Throws on failure.
layer_arena alloc_arena(ggml_context * ctx, ggml_backend_buffer_type_t buft, const layer_layout & l, int32_t n_slots);

void free_arena(layer_arena & a);

// Copy one expert block into a slot (synchronous).
void arena_store(layer_arena & a, int32_t slot, const void * block, size_t n);
// Copy a slot's block out into host memory (synchronous).
void arena_load(const layer_arena & a, int32_t slot, void * block, size_t n);

}  // namespace expert_pack
