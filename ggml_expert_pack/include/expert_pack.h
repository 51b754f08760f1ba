// expert_pack.h -- C API of the expert-pack runtime provider (libggml-expert-pack).
//
// A provider streams the routed experts of a MoE model from an expert pack (docs/FORMAT.md) into a cache
// of whole experts, inside llama.cpp's compute graph (docs/ARCHITECTURE.md). Python binds this header
// with cffi (ggml_expert_pack.pybind). llama.cpp reaches the "llama.cpp integration" part through the table of
// expert_pack_llama_source(), never directly.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(EXPERT_PACK_BUILD)
#    define EXPERT_PACK_API __attribute__((visibility("default")))
#else
#    define EXPERT_PACK_API
#endif

struct ggml_tensor;
struct ggml_backend_device;
struct llama_expert_source_i;  // llama.h

typedef struct expert_pack_provider expert_pack_provider;
typedef struct expert_pack_layer    expert_pack_layer;

// Version of the provider library ("MAJOR.MINOR.PATCH").
EXPERT_PACK_API const char * expert_pack_version(void);

// ---- configuration and lifetime --------------------------------------------------------------------------
// The configuration is a JSON object with the keys that expert_pack_config_schema lists (docs/ARCHITECTURE.md,
// "Configuration"). Unknown keys and bad values are errors naming the key.

// 0 if `config_json` is a valid configuration; otherwise -1 and a one-line message in err.
EXPERT_PACK_API int expert_pack_config_validate(const char * config_json, char * err, size_t err_len);
// Every configuration key as a JSON array: [{"name", "type" (path|string|size|size_or_auto|int|bool|enum),
// "default", "help", "min"/"max" (int), "values" (enum)}]. The one description of the configuration, which the
// bindings, front ends and docs are checked against. Returns the length; copies it (NUL-terminated) when len > it.
EXPERT_PACK_API size_t expert_pack_config_schema(char * buf, size_t len);

// Open a pack: validate the configuration, the manifest, the pack header and the files, open the pack
// (O_DIRECT when direct_io). Fails closed: NULL with the cause in err (e.g. a filesystem that refuses
// O_DIRECT, a misaligned pack, a pack from another model).
EXPERT_PACK_API expert_pack_provider * expert_pack_open(const char * config_json, char * err, size_t err_len);

// Free a provider (after the llama_model that uses it). Writes a final stats file if stats_path is set.
EXPERT_PACK_API void expert_pack_free(expert_pack_provider * p);

// ---- statistics and control ------------------------------------------------------------------------------
// Counters are per unique (layer, expert) key per step; a step is one graph compute (one ubatch).
typedef struct expert_pack_stats {
    uint64_t cache_hits;       // keys found in the cache
    uint64_t cache_misses;     // keys loaded from the pack
    uint64_t cache_evictions;  // cached experts replaced by a miss
    uint64_t pack_read_bytes;  // bytes read from the pack
    uint64_t h2d_bytes;        // bytes copied from staging into the cache (host-to-device on a GPU)
    uint64_t fallback_count;   // diagnosable detours: short reads retried, steps split into chunks
    uint64_t io_errors;        // failed reads, checksum mismatches
    uint64_t steps;            // graph computes that used the provider
    // the host-RAM tier (ram_cache_mib); every cache miss is a RAM hit or a RAM miss, so
    // cache_misses == ram_hits + ram_misses, and pack_read_bytes counts the RAM misses' reads (with the tier
    // off every cache miss is a RAM miss)
    uint64_t ram_hits;         // cache misses served from the RAM tier (no pack read)
    uint64_t ram_misses;       // cache misses read from the pack
    uint64_t ram_evictions;    // RAM blocks replaced (by a miss, a spill or a prefetch)
    uint64_t ram_spills;       // experts the device evicted, copied from their slots back into the tier
                               // (ram_tier_mode "spill"; device-to-host on a GPU, no pack read)
    uint64_t ram_blocks;       // the tier's size in blocks (0: off), and in bytes (not reset by reset_stats)
    uint64_t ram_bytes;
    // next-layer prefetch (prefetch): reads of predicted experts into the RAM tier while the device computes.
    // Their bytes are in pack_read_bytes; a used one turns a later cache miss into a RAM hit.
    uint64_t prefetch_issued;     // prefetch reads queued
    uint64_t prefetch_used;       // prefetched blocks a cache miss then took from the RAM tier
    uint64_t prefetch_wasted;     // prefetched blocks read but dropped before any use
    uint64_t prefetch_cancelled;  // prefetch reads dropped before they started (the next layer's acquire drops every
                                  // one not started, its needed ones then being read with its other misses; or
                                  // their block was taken for another expert first)
    uint64_t predicted;           // experts predicted for a layer (distinct per step)
    uint64_t predicted_correct;   // of those, the ones that layer's next step selected (accuracy = correct / predicted)
} expert_pack_stats;

EXPERT_PACK_API void expert_pack_get_stats(const expert_pack_provider * p, expert_pack_stats * out);
EXPERT_PACK_API void expert_pack_reset_stats(expert_pack_provider * p);
// Drop every expert cached on the devices (the next steps load them again: from the RAM tier where it holds
// them, else from the pack). The RAM tier keeps its blocks.
EXPERT_PACK_API void expert_pack_reset_cache(expert_pack_provider * p);
// The stats file's content (JSON): counters, cache geometry, configuration. Returns the length written
// (without the terminating 0), or the length needed if buf is too small.
EXPERT_PACK_API size_t expert_pack_stats_json(const expert_pack_provider * p, char * buf, size_t len);
// The last runtime error ("" if none). Set when a step fails (an I/O error, a checksum mismatch).
EXPERT_PACK_API const char * expert_pack_last_error(const expert_pack_provider * p);
// Slots per MoE layer, and the largest ubatch the context must use (0: no limit; a limit only when steps
// cannot be split into rounds), once attached.
EXPERT_PACK_API int32_t  expert_pack_slots_per_layer(const expert_pack_provider * p);
EXPERT_PACK_API uint32_t expert_pack_max_ubatch(const expert_pack_provider * p);
// One line saying how the cache was sized, once attached: slots per MoE layer, MiB on each device and where the
// budget came from, the host-RAM tier, resident layers. Returns the length written (without the terminating 0), or
// the length needed if buf is too small ("" before attach).
EXPERT_PACK_API size_t expert_pack_summary(const expert_pack_provider * p, char * buf, size_t len);
// The per-layer timeline of the last complete step (JSON, src/timeline.h): when each layer's acquire began, its plan,
// each miss's submit / read start / read end / checksum end / copy queued, and its end (microseconds from the
// step's first acquire). Returns the length as expert_pack_stats_json does.
EXPERT_PACK_API size_t expert_pack_timeline_json(const expert_pack_provider * p, char * buf, size_t len);

// ---- llama.cpp integration --------------------------------------------------------------------------------
// The provider as llama.cpp's expert source: pass this table as llama_model_params.expert_source and the provider
// as expert_source_ctx (src/llama_source.cpp; its members call the functions below). Static, never freed.
EXPERT_PACK_API const struct llama_expert_source_i * expert_pack_llama_source(void);

// Check that the model file belongs with this pack: a trunk must carry this pack's pack_id; an original GGUF
// (or the first shard of one) must be the pack's source (its fingerprint). 0 if it does; -1 with the cause in err.
EXPERT_PACK_API int expert_pack_check_model(expert_pack_provider * p, const char * path, char * err, size_t err_len);
// The pack's identity (pack_id, 32 hex digits).
EXPERT_PACK_API const char * expert_pack_id(const expert_pack_provider * p);
// Whether `name` is a routed-expert tensor held by the pack.
EXPERT_PACK_API int expert_pack_has_tensor(const expert_pack_provider * p, const char * name);
// The shape/type-only tensor standing for a packed expert tensor (never allocated, never read). `ne` is the
// shape the architecture expects; a mismatch with the manifest is an error (NULL, message in err).
EXPERT_PACK_API struct ggml_tensor * expert_pack_tensor(expert_pack_provider * p, const char * name, int n_dims,
                                                        const int64_t * ne, char * err, size_t err_len);
// Allocate the cache arenas, each MoE layer's on the device that runs that layer (layer_devs[il]; NULL: CPU),
// from the byte budget. 0 on success; -1 with the numbers in err (e.g. a cache below one token's experts).
EXPERT_PACK_API int expert_pack_attach(expert_pack_provider * p, int n_layer,
                                       struct ggml_backend_device * const * layer_devs, int n_expert_used,
                                       char * err, size_t err_len);
// Free the arenas (the model goes away; the provider may be attached to another).
EXPERT_PACK_API void expert_pack_detach(expert_pack_provider * p);
// The layer handle of a packed expert tensor (NULL if `t` is not one).
EXPERT_PACK_API expert_pack_layer * expert_pack_layer_of(const struct ggml_tensor * t);
// Non-zero when every expert of the layer is cached in slot == expert (preloaded when the whole layer fits):
// the graph then uses the router's ids directly and needs no acquire op (no per-step work, no counters).
EXPERT_PACK_API int expert_pack_layer_resident(const expert_pack_layer * l);
// The cache arena view that replaces expert tensor `t` in mul_mat_id (ne[2] = slots).
EXPERT_PACK_API struct ggml_tensor * expert_pack_layer_arena(expert_pack_layer * l, const struct ggml_tensor * t);
// How many rounds a step of `n_tokens` needs in this layer: 1 when its distinct experts always fit the slots;
// otherwise the experts are served in groups of at most `slots`, one acquire op per round (the other pairs of
// a round get a zero input through expert_pack_round_mask and the rounds' outputs are summed).
EXPERT_PACK_API int32_t expert_pack_layer_rounds(expert_pack_layer * l, int64_t n_tokens);
// The userdata of round `round` of `n_rounds` for the acquire op (stable while attached).
EXPERT_PACK_API void * expert_pack_layer_round(expert_pack_layer * l, int32_t round, int32_t n_rounds);
// Steps may not be split into rounds (per-expert biases would make the zero slot's output non-zero): the
// context caps its ubatch instead. Call before creating contexts.
EXPERT_PACK_API void expert_pack_disable_rounds(expert_pack_provider * p);
// The graph op (ggml_custom_4d, userdata from expert_pack_layer_round): expert ids (src[0], I32 [k, n_tokens])
// -> cache slot ids (dst, same shape), loading this round's misses before it returns.
EXPERT_PACK_API void expert_pack_acquire(struct ggml_tensor * dst, int ith, int nth, void * userdata);
// The graph op after a round's acquire op (ggml_custom_4d, F32 [1, k, n_tokens], src[0] = that acquire op's output,
// same userdata): 1 for the (token, pair)s the round serves, 0 for the others, whose expert input the graph multiplies
// by 0 -- they read another slot of the cache (a token's slot ids must stay distinct on the GPU) and add exact zeros.
EXPERT_PACK_API void expert_pack_round_mask(struct ggml_tensor * dst, int ith, int nth, void * userdata);
// Next-layer prefetch (config key prefetch, with a RAM tier). After attaching, the model hands over each MoE
// layer's router: gate_inp [n_embd, n_expert], and where the arch has them the logit bias and the selection bias
// (NULLs otherwise). At layer il the graph may then predict layer il + 1: when this returns that layer (else NULL),
// it multiplies the next router with layer il's router input, takes the top-k and passes them (I32 [k, n_tokens])
// to expert_pack_prefetch, an op that queues background reads into the RAM tier and returns at once.
EXPERT_PACK_API void expert_pack_set_router(expert_pack_provider * p, int il, struct ggml_tensor * gate_inp,
                                            struct ggml_tensor * gate_inp_b, struct ggml_tensor * exp_probs_b);
EXPERT_PACK_API expert_pack_layer * expert_pack_layer_prefetch_target(expert_pack_layer * l, struct ggml_tensor ** gate_inp,
                                                                     struct ggml_tensor ** gate_inp_b,
                                                                     struct ggml_tensor ** exp_probs_b);
// The graph op (ggml_custom_4d, userdata = the layer from expert_pack_layer_prefetch_target): src[0] the predicted
// expert ids; any further src only orders it (after the current layer's acquire op: demand misses first).
EXPERT_PACK_API void expert_pack_prefetch(struct ggml_tensor * dst, int ith, int nth, void * userdata);
// Non-zero if a step failed since the last call (which clears the flag); the message is expert_pack_last_error.
EXPERT_PACK_API int expert_pack_take_step_error(expert_pack_provider * p);
// A graph compute of n_tokens finished: resident layers (every expert cached, no per-step work) count their
// experts as hits (min(n_experts, k * n_tokens) per layer: exact for single-token steps), and a step in which no
// layer acquired is counted.
EXPERT_PACK_API void expert_pack_step_done(expert_pack_provider * p, int64_t n_tokens);

// Test seam: serve rounds on the CPU with the GPU's slot assignment (a token's slot ids distinct).
EXPERT_PACK_API void expert_pack_test_distinct_round_slots(expert_pack_provider * p, int on);
// Test seam: while on, no prefetch read starts (every prefetch is dropped at the next layer's acquire).
EXPERT_PACK_API void expert_pack_test_hold_prefetch(expert_pack_provider * p, int on);
// Test seam: after `n` more block reads, every read fails with EIO until called again with -1.
EXPERT_PACK_API void expert_pack_test_inject_eio(expert_pack_provider * p, int64_t n);

// ---- the cache policy on its own (unit tests, simulators) -------------------------------------------------
typedef struct expert_pack_policy expert_pack_policy;
EXPERT_PACK_API expert_pack_policy * expert_pack_policy_new(int32_t n_slots, int32_t n_experts);
// One step: the experts one layer needs (duplicates allowed). Writes each one's slot into slots_out and adds
// to the counters. Returns -1 (nothing changed) if the step needs more distinct experts than there are slots.
EXPERT_PACK_API int expert_pack_policy_step(expert_pack_policy * pol, const int32_t * experts, int32_t n,
                                            int32_t * slots_out, uint64_t * hits, uint64_t * misses,
                                            uint64_t * evictions);
// Mark a slot busy (still being written by a background read): it is a victim only when no other unpinned slot is
// free of that. The RAM tier marks the blocks of running prefetch reads so.
EXPERT_PACK_API void expert_pack_policy_set_busy(expert_pack_policy * pol, int32_t slot, int busy);
EXPERT_PACK_API void expert_pack_policy_free(expert_pack_policy * pol);

// ---- hashing (checksums and fingerprints of docs/FORMAT.md) ----------------------------------------------
// XXH3-128 of a buffer, as 16 bytes in canonical (big-endian) order.
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
