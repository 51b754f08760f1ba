// Checksums of expert blocks and fingerprints: XXH3-128 (xxHash, vendored in llama.cpp).
// Every block read at run time is checked, hundreds of MB per decoded token, so the one-shot hash picks the
// widest vector unit the CPU has: release builds are not -march=native (GGML_NATIVE=OFF), which leaves this file
// at the baseline (SSE2 on x86-64, 17 GB/s on the dev machine); checksum_avx2.cpp is the same code built for AVX2
// (docs/BENCHMARKS.md, "Checksum speed"). Both compute the same XXH3 (tests/test_packer.py checks known answers
// and both paths against each other).
#define XXH_INLINE_ALL
#include "xxhash.h"

#include "expert_pack.h"

#include <cstdlib>

#if defined(EXPERT_PACK_HAVE_AVX2)
namespace expert_pack {
XXH128_hash_t xxh3_128_avx2(const void * data, size_t size);  // checksum_avx2.cpp
void xxh3_128_update_avx2(void * state, const void * data, size_t size);
}

static bool use_avx2() {
    // EXPERT_PACK_XXH3_BASELINE=1 forces the baseline path (tests compare the two)
    static const bool yes = __builtin_cpu_supports("avx2") && !std::getenv("EXPERT_PACK_XXH3_BASELINE");
    return yes;
}
#endif

extern "C" void expert_pack_xxh3_128(const void * data, size_t size, uint8_t out[16]) {
#if defined(EXPERT_PACK_HAVE_AVX2)
    const XXH128_hash_t h = use_avx2() ? expert_pack::xxh3_128_avx2(data, size) : XXH3_128bits(data, size);
#else
    const XXH128_hash_t h = XXH3_128bits(data, size);
#endif
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
#if defined(EXPERT_PACK_HAVE_AVX2)
    if (use_avx2()) {
        expert_pack::xxh3_128_update_avx2(&h->state, data, size);
        return;
    }
#endif
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
