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

// Version of the provider library ("MAJOR.MINOR.PATCH").
EXPERT_PACK_API const char * expert_pack_version(void);

#ifdef __cplusplus
}
#endif
