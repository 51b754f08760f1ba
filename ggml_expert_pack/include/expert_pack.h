// expert_pack.h -- C API of the expert-pack runtime provider (libggml-expert-pack).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

#if defined(EXPERT_PACK_BUILD)
#    define EXPERT_PACK_API __attribute__((visibility("default")))
#else
#    define EXPERT_PACK_API
#endif

#include <stddef.h>
#include <stdint.h>

// Version of the provider library ("MAJOR.MINOR.PATCH").
EXPERT_PACK_API const char * expert_pack_version(void);

// XXH3-128 of a buffer, as 16 bytes in canonical (big-endian) order: the checksum of expert blocks and
// the fingerprints of docs/FORMAT.md.
EXPERT_PACK_API void expert_pack_xxh3_128(const void * data, size_t size, uint8_t out[16]);

// Streaming form of the same hash.
typedef struct expert_pack_hasher expert_pack_hasher;
EXPERT_PACK_API expert_pack_hasher * expert_pack_hasher_new(void);
EXPERT_PACK_API void expert_pack_hasher_update(expert_pack_hasher * h, const void * data, size_t size);
EXPERT_PACK_API void expert_pack_hasher_digest(expert_pack_hasher * h, uint8_t out[16]);
EXPERT_PACK_API void expert_pack_hasher_free(expert_pack_hasher * h);

#ifdef __cplusplus
}
#endif
