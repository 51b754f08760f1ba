// Checksums of expert blocks and fingerprints: XXH3-128 (xxHash, vendored in llama.cpp).
// ~15-30 GB/s per core: cheap enough to check every block as it is read at run time.
#define XXH_INLINE_ALL
#include "xxhash.h"

#include "expert_pack.h"

extern "C" void expert_pack_xxh3_128(const void * data, size_t size, uint8_t out[16]) {
    const XXH128_hash_t h = XXH3_128bits(data, size);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);  // big-endian byte order: the hex string reads the same everywhere
    for (int i = 0; i < 16; ++i) {
        out[i] = c.digest[i];
    }
}

struct expert_pack_hasher {
    XXH3_state_t state;
};

extern "C" expert_pack_hasher * expert_pack_hasher_new(void) {
    auto * h = new expert_pack_hasher;
    XXH3_128bits_reset(&h->state);
    return h;
}

extern "C" void expert_pack_hasher_update(expert_pack_hasher * h, const void * data, size_t size) {
    XXH3_128bits_update(&h->state, data, size);
}

extern "C" void expert_pack_hasher_digest(expert_pack_hasher * h, uint8_t out[16]) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&h->state));
    for (int i = 0; i < 16; ++i) {
        out[i] = c.digest[i];
    }
}

extern "C" void expert_pack_hasher_free(expert_pack_hasher * h) {
    delete h;
}
