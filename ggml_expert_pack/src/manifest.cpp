#include "manifest.h"

#include "expert_pack.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace expert_pack {

using json = nlohmann::json;

std::string to_hex(const uint8_t * data, size_t n) {
    static const char * d = "0123456789abcdef";
    std::string s(2 * n, '0');
    for (size_t i = 0; i < n; ++i) {
        s[2 * i] = d[data[i] >> 4];
        s[2 * i + 1] = d[data[i] & 15];
    }
    return s;
}

static std::array<uint8_t, 16> from_hex16(const std::string & s, const std::string & what) {
    std::array<uint8_t, 16> out{};
    if (s.size() != 32) {
        throw std::runtime_error("manifest: " + what + " is not 32 hex digits");
    }
    for (size_t i = 0; i < 16; ++i) {
        unsigned v = 0;
        if (sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) {
            throw std::runtime_error("manifest: " + what + " is not hex");
        }
        out[i] = (uint8_t) v;
    }
    return out;
}

static ggml_type type_from_name(const std::string & name, int type_id) {
    if (type_id < 0 || type_id >= GGML_TYPE_COUNT || ggml_get_type_traits((ggml_type) type_id)->blck_size == 0) {
        throw std::runtime_error("manifest: unknown ggml type id " + std::to_string(type_id));
    }
    const ggml_type t = (ggml_type) type_id;
    std::string ours = ggml_type_name(t);
    std::string theirs = name;
    for (auto & c : ours) c = (char) toupper(c);
    for (auto & c : theirs) c = (char) toupper(c);
    if (ours != theirs) {
        throw std::runtime_error("manifest: type " + name + " does not match type id " + std::to_string(type_id));
    }
    return t;
}

const layer_layout * manifest::find_layer(int32_t layer) const {
    for (const auto & l : layers) {
        if (l.layer == layer) {
            return &l;
        }
    }
    return nullptr;
}

manifest load_manifest(const std::string & path) {
    std::ifstream f(path);
    if (!f) {
        throw std::runtime_error("cannot open manifest " + path + ": " + strerror(errno));
    }
    json j;
    try {
        j = json::parse(f);
    } catch (const json::exception & e) {
        throw std::runtime_error("manifest " + path + " is not valid JSON: " + e.what());
    }
    manifest m;
    try {
        if (j.at("format") != "expert-pack") {
            throw std::runtime_error("manifest " + path + " is not an expert-pack manifest");
        }
        if (j.at("version") != 1) {
            throw std::runtime_error("manifest " + path + ": unsupported version " + j.at("version").dump());
        }
        m.pack_id = j.at("pack_id").get<std::string>();
        m.manifest_digest = j.at("manifest_digest").get<std::string>();
        m.source_fingerprint = j.at("source").at("fingerprint").get<std::string>();
        m.arch = j.at("source").at("arch").get<std::string>();
        m.n_experts = j.at("n_experts").get<int32_t>();
        const auto & pk = j.at("pack");
        m.pack_size = pk.at("size").get<uint64_t>();
        m.data_start = pk.at("data_start").get<uint64_t>();
        m.data_size = pk.at("data_size").get<uint64_t>();
        if (pk.at("alignment").get<uint64_t>() != PACK_ALIGNMENT) {
            throw std::runtime_error("manifest: alignment is not 4096");
        }
        for (const auto & lj : j.at("layers")) {
            layer_layout l;
            l.layer = lj.at("layer").get<int32_t>();
            l.offset = lj.at("offset").get<uint64_t>();
            l.expert_stride = lj.at("expert_stride").get<uint64_t>();
            l.block_bytes = lj.at("block_bytes").get<uint64_t>();
            l.read_bytes = (l.block_bytes + PACK_ALIGNMENT - 1) / PACK_ALIGNMENT * PACK_ALIGNMENT;
            for (const auto & rj : lj.at("roles")) {
                role_layout r;
                r.role = rj.at("role").get<std::string>();
                r.tensor = rj.at("tensor").get<std::string>();
                r.type = type_from_name(rj.at("type").get<std::string>(), rj.at("type_id").get<int>());
                const auto & sh = rj.at("shape");
                if (sh.size() != 3) {
                    throw std::runtime_error("manifest: " + r.tensor + " shape is not 3-D");
                }
                for (int d = 0; d < 3; ++d) r.ne[d] = sh[d].get<int64_t>();
                r.offset = rj.at("offset").get<uint64_t>();
                r.bytes = rj.at("bytes").get<uint64_t>();
                l.roles.push_back(r);
            }
            for (const auto & c : lj.at("checksums")) {
                l.checksums.push_back(from_hex16(c.get<std::string>(), "a checksum of layer " + std::to_string(l.layer)));
            }
            m.layers.push_back(std::move(l));
        }
    } catch (const json::exception & e) {
        throw std::runtime_error("manifest " + path + " is malformed: " + e.what());
    }

    // fail closed on anything a reader would trip over
    if (m.n_experts <= 0 || m.layers.empty()) {
        throw std::runtime_error("manifest: no experts");
    }
    if (m.data_start != PACK_HEADER_SIZE || m.pack_size != m.data_start + m.data_size) {
        throw std::runtime_error("manifest: pack geometry is inconsistent (data_start/data_size/size)");
    }
    uint64_t expect = m.data_start;
    for (const auto & l : m.layers) {
        const std::string where = "layer " + std::to_string(l.layer);
        if (l.offset % PACK_ALIGNMENT || l.expert_stride % PACK_ALIGNMENT) {
            throw std::runtime_error("misaligned pack: " + where + " blocks at offset " + std::to_string(l.offset) +
                                     " with stride " + std::to_string(l.expert_stride) + " (must be multiples of 4096)");
        }
        if (l.offset != expect || l.block_bytes == 0 || l.read_bytes > l.expert_stride) {
            throw std::runtime_error("manifest: " + where + " block layout is inconsistent");
        }
        if ((int32_t) l.checksums.size() != m.n_experts) {
            throw std::runtime_error("manifest: " + where + " has " + std::to_string(l.checksums.size()) +
                                     " checksums for " + std::to_string(m.n_experts) + " experts");
        }
        uint64_t end = 0;
        for (const auto & r : l.roles) {
            if (r.ne[2] != m.n_experts || r.offset < end ||
                r.bytes != ggml_row_size(r.type, r.ne[0]) * (uint64_t) r.ne[1] || r.ne[0] % ggml_blck_size(r.type)) {
                throw std::runtime_error("manifest: " + where + " role " + r.role + " is inconsistent");
            }
            end = r.offset + r.bytes;
        }
        if (end > l.block_bytes) {
            throw std::runtime_error("manifest: " + where + " roles overflow the block");
        }
        expect = l.offset + l.expert_stride * (uint64_t) m.n_experts;
    }
    if (expect != m.pack_size) {
        throw std::runtime_error("manifest: layers do not cover the pack's data region");
    }
    return m;
}

void check_pack_header(const uint8_t * h, uint64_t file_size, const manifest & m) {
    if (memcmp(h, "GGEXPACK", 8) != 0) {
        throw std::runtime_error("not an expert pack (bad magic)");
    }
    auto u32 = [&](size_t off) { uint32_t v; memcpy(&v, h + off, 4); return v; };
    auto u64 = [&](size_t off) { uint64_t v; memcpy(&v, h + off, 8); return v; };
    if (u32(8) != 1) {
        throw std::runtime_error("unsupported expert pack version " + std::to_string(u32(8)));
    }
    uint8_t check[16];
    expert_pack_xxh3_128(h, 108, check);
    if (memcmp(check, h + 108, 16) != 0) {
        throw std::runtime_error("pack header checksum mismatch (corrupt header)");
    }
    if (u32(12) != PACK_HEADER_SIZE || u32(16) != PACK_ALIGNMENT) {
        throw std::runtime_error("misaligned pack: header declares alignment " + std::to_string(u32(16)));
    }
    if (to_hex(h + 56, 16) != m.pack_id) {
        throw std::runtime_error("the pack (pack_id " + to_hex(h + 56, 16) + ") and the manifest (pack_id " +
                                 m.pack_id + ") belong to different builds");
    }
    if (to_hex(h + 72, 16) != m.manifest_digest) {
        throw std::runtime_error("the manifest was modified after the pack was built (digest mismatch)");
    }
    if ((int32_t) u32(24) != m.n_experts || (size_t) u32(20) != m.layers.size() || u64(32) != m.data_start ||
        u64(40) != m.data_size) {
        throw std::runtime_error("pack header geometry does not match the manifest");
    }
    if (file_size != m.pack_size) {
        throw std::runtime_error("pack file is " + std::to_string(file_size) + " bytes, the manifest says " +
                                 std::to_string(m.pack_size) + (file_size < m.pack_size ? " (truncated)" : ""));
    }
}

}  // namespace expert_pack
