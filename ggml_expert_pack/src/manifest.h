// Reading an expert pack: manifest.json (authoritative layout) and the experts.pack header, with fail-closed
// validation (docs/FORMAT.md).
#pragma once

#include "ggml.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace expert_pack {

constexpr uint64_t PACK_ALIGNMENT = 4096;
constexpr uint64_t PACK_HEADER_SIZE = 4096;

struct role_layout {
    std::string role;          // gate, up, gate_up, down
    std::string tensor;        // blk.N.ffn_<role>_exps.weight
    ggml_type   type;
    int64_t     ne[3];         // ne0, ne1, n_experts
    uint64_t    offset;        // inside the block
    uint64_t    bytes;         // of one expert
};

struct layer_layout {
    int32_t  layer;            // the model's block index
    uint64_t offset;           // file offset of expert 0's block
    uint64_t expert_stride;
    uint64_t block_bytes;
    uint64_t read_bytes;       // block_bytes rounded up to PACK_ALIGNMENT: one aligned read per expert
    std::vector<role_layout> roles;
    std::vector<std::array<uint8_t, 16>> checksums;  // XXH3-128 of block[0:block_bytes], per expert

    uint64_t expert_offset(int32_t e) const { return offset + (uint64_t) e * expert_stride; }
};

struct manifest {
    std::string pack_id;
    std::string manifest_digest;
    std::string source_fingerprint;
    std::string arch;
    int32_t     n_experts = 0;
    uint64_t    pack_size = 0;
    uint64_t    data_start = 0;
    uint64_t    data_size = 0;
    std::string trunk_file;                // trunk.gguf, beside the manifest
    uint64_t    trunk_size = 0;
    int64_t     trunk_n_tensors = 0;
    uint64_t    trunk_header_size = 0;     // the trunk's header and KV region [0, header_size) ...
    std::string trunk_header_checksum;     // ... and its XXH3-128 ("" in packs built before it was recorded)
    std::vector<layer_layout> layers;

    const layer_layout * find_layer(int32_t layer) const;
};

// Parse and validate manifest.json as `expert-pack verify --quick` does (bounded size, the digest and pack_id
// recomputed, every value range-checked before it is used); throws std::runtime_error with a one-line cause.
manifest load_manifest(const std::string & path);

// Validate the 4096-byte pack header against the manifest (magic, version, header checksum, pack_id,
// manifest digest, geometry); throws std::runtime_error naming the mismatch.
void check_pack_header(const uint8_t * header, uint64_t file_size, const manifest & m);

std::string to_hex(const uint8_t * data, size_t n);

}  // namespace expert_pack
