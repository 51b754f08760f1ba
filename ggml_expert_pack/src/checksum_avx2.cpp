// XXH3-128 built for AVX2 (this file only is compiled with -mavx2; checksum.cpp calls it when the CPU has AVX2).
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include "xxhash.h"

namespace expert_pack {

XXH128_hash_t xxh3_128_avx2(const void * data, size_t size) {
    return XXH3_128bits(data, size);
}

// the streaming hasher's update (the state is checksum.cpp's XXH3_state_t: the same header, the same layout)
void xxh3_128_update_avx2(void * state, const void * data, size_t size) {
    XXH3_128bits_update((XXH3_state_t *) state, data, size);
}

}  // namespace expert_pack
