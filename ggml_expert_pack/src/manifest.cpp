#include "manifest.h"

#include "expert_pack.h"

#include <nlohmann/json.hpp>

#include <cerrno>
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

// XXH3-128 of the canonical JSON of `j` (keys sorted, no whitespace, ASCII): what the packer hashes (packer/format.py)
static std::string canonical_digest(const json & j) {
    const std::string text = j.dump(-1, ' ', true, json::error_handler_t::strict);
    uint8_t d[16];
    expert_pack_xxh3_128(text.data(), text.size(), d);
    return to_hex(d, 16);
}

// an integer field in [lo, hi] (never a float, a bool or a string), named in the error
static int64_t get_int(const json & o, const char * key, int64_t lo, int64_t hi, const std::string & where) {
    const json & v = o.at(key);
    if (!v.is_number_integer()) {
        throw std::runtime_error("manifest: " + where + key + " is not an integer");
    }
    if (v.is_number_unsigned() ? v.get<uint64_t>() > (uint64_t) hi : (v.get<int64_t>() < lo || v.get<int64_t>() > hi)) {
        throw std::runtime_error("manifest: " + where + key + " = " + v.dump() + " is out of range [" +
                                 std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return v.is_number_unsigned() ? (int64_t) v.get<uint64_t>() : v.get<int64_t>();
}

static std::string get_str(const json & o, const char * key, const std::string & where) {
    const json & v = o.at(key);
    if (!v.is_string()) {
        throw std::runtime_error("manifest: " + where + key + " is not a string");
    }
    return v.get<std::string>();
}

static const json & get_obj(const json & o, const char * key, const std::string & where) {
    const json & v = o.at(key);
    if (!v.is_object()) {
        throw std::runtime_error("manifest: " + where + key + " is not an object");
    }
    return v;
}

static const json & get_arr(const json & o, const char * key, const std::string & where) {
    const json & v = o.at(key);
    if (!v.is_array()) {
        throw std::runtime_error("manifest: " + where + key + " is not a list");
    }
    return v;
}

// limits no real pack comes near, so that no later arithmetic can overflow
constexpr int64_t MAX_MANIFEST_BYTES = 256ll << 20;  // a 1 TB model's manifest is a few MB
constexpr int64_t MAX_LAYERS = 1 << 16;
constexpr int64_t MAX_EXPERTS = 1 << 16;
constexpr int64_t MAX_DIM = 1 << 24;
constexpr int64_t MAX_OFFSET = 1ll << 56;  // 64 PiB

manifest load_manifest(const std::string & path) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) {
        throw std::runtime_error("cannot open manifest " + path + ": " + strerror(errno));
    }
    const std::streamoff size = f.tellg();
    if (size < 0 || size > MAX_MANIFEST_BYTES) {
        throw std::runtime_error("manifest " + path + " is " + std::to_string((long long) size) +
                                 " bytes, more than any pack's (at most " + std::to_string(MAX_MANIFEST_BYTES >> 20) +
                                 " MiB): not a manifest the packer wrote");
    }
    std::string text((size_t) size, '\0');
    f.seekg(0);
    if (!f.read(text.data(), size)) {
        throw std::runtime_error("cannot read manifest " + path);
    }
    json j;
    try {
        j = json::parse(text);
    } catch (const json::exception & e) {
        throw std::runtime_error("manifest " + path + " is not valid JSON: " + e.what());
    }
    text.clear();
    text.shrink_to_fit();
    if (!j.is_object() || !j.contains("format") || j["format"] != "expert-pack") {
        throw std::runtime_error("manifest " + path + " is not an expert-pack manifest");
    }
    manifest m;
    std::string identity_digest;
    try {
        if (j.at("version") != 1) {
            throw std::runtime_error("manifest " + path + ": unsupported version " + j.at("version").dump());
        }
        // the digest first: a manifest edited after the build is refused before anything in it is used
        m.manifest_digest = get_str(j, "manifest_digest", "");
        {
            json body = j;
            body.erase("manifest_digest");
            if (canonical_digest(body) != m.manifest_digest) {
                throw std::runtime_error("manifest " + path + " was modified after the build (its digest does not "
                                         "match its content)");
            }
        }
        m.pack_id = get_str(j, "pack_id", "");
        const json & src = get_obj(j, "source", "");
        m.source_fingerprint = get_str(src, "fingerprint", "source.");
        m.arch = get_str(src, "arch", "source.");
        m.n_experts = (int32_t) get_int(j, "n_experts", 1, MAX_EXPERTS, "");
        const json & pk = get_obj(j, "pack", "");
        m.pack_size = (uint64_t) get_int(pk, "size", 0, MAX_OFFSET, "pack.");
        m.data_start = (uint64_t) get_int(pk, "data_start", 0, MAX_OFFSET, "pack.");
        m.data_size = (uint64_t) get_int(pk, "data_size", 0, MAX_OFFSET, "pack.");
        if (get_int(pk, "alignment", 0, MAX_OFFSET, "pack.") != (int64_t) PACK_ALIGNMENT) {
            throw std::runtime_error("manifest: alignment is not 4096");
        }
        const json & tr = get_obj(j, "trunk", "");
        m.trunk_file = get_str(tr, "file", "trunk.");
        m.trunk_size = (uint64_t) get_int(tr, "size", 0, MAX_OFFSET, "trunk.");
        m.trunk_n_tensors = get_int(tr, "n_tensors", 0, 1 << 24, "trunk.");
        if (tr.contains("header_checksum")) {  // packs built before it was recorded lack it
            m.trunk_header_size = (uint64_t) get_int(tr, "header_size", 0, MAX_MANIFEST_BYTES, "trunk.");
            m.trunk_header_checksum = get_str(tr, "header_checksum", "trunk.");
        }
        if (m.trunk_file.empty() || m.trunk_file.find('/') != std::string::npos || m.trunk_file == "." ||
            m.trunk_file == "..") {
            throw std::runtime_error("manifest: trunk.file is not a file name");
        }
        const json & layers = get_arr(j, "layers", "");
        if (layers.empty() || (int64_t) layers.size() > MAX_LAYERS) {
            throw std::runtime_error("manifest: " + std::to_string(layers.size()) + " layers");
        }
        // the layout identity that pack_id hashes (packer/format.py layout_identity)
        json identity = {{"format", "expert-pack"}, {"version", 1}, {"source_fingerprint", m.source_fingerprint},
                         {"n_experts", m.n_experts}, {"alignment", PACK_ALIGNMENT}, {"layers", json::array()}};
        for (const auto & lj : layers) {
            if (!lj.is_object()) {
                throw std::runtime_error("manifest: a layer entry is not an object");
            }
            layer_layout l;
            l.layer = (int32_t) get_int(lj, "layer", 0, MAX_LAYERS - 1, "layer.");
            const std::string where = "layer " + std::to_string(l.layer) + ": ";
            if (m.find_layer(l.layer)) {
                throw std::runtime_error("manifest: layer " + std::to_string(l.layer) + " is listed twice");
            }
            l.offset = (uint64_t) get_int(lj, "offset", 0, MAX_OFFSET, where);
            l.expert_stride = (uint64_t) get_int(lj, "expert_stride", 1, MAX_OFFSET / MAX_EXPERTS, where);
            l.block_bytes = (uint64_t) get_int(lj, "block_bytes", 1, MAX_OFFSET / MAX_EXPERTS, where);
            l.read_bytes = (l.block_bytes + PACK_ALIGNMENT - 1) / PACK_ALIGNMENT * PACK_ALIGNMENT;
            json id_layer = {{"layer", l.layer}, {"offset", l.offset}, {"expert_stride", l.expert_stride},
                             {"block_bytes", l.block_bytes}, {"roles", json::array()}};
            const json & roles = get_arr(lj, "roles", where);
            if (roles.empty() || roles.size() > 4) {
                throw std::runtime_error("manifest: " + where + std::to_string(roles.size()) + " roles");
            }
            for (const auto & rj : roles) {
                if (!rj.is_object()) {
                    throw std::runtime_error("manifest: " + where + "a role entry is not an object");
                }
                role_layout r;
                r.role = get_str(rj, "role", where);
                if (r.role != "gate" && r.role != "up" && r.role != "gate_up" && r.role != "down") {
                    throw std::runtime_error("manifest: " + where + "unknown role '" + r.role + "'");
                }
                for (const auto & other : l.roles) {
                    if (other.role == r.role) {
                        throw std::runtime_error("manifest: " + where + "role " + r.role + " is listed twice");
                    }
                }
                r.tensor = get_str(rj, "tensor", where);
                const std::string type_name = get_str(rj, "type", where);
                const int64_t type_id = get_int(rj, "type_id", 0, GGML_TYPE_COUNT - 1, where);
                r.type = type_from_name(type_name, (int) type_id);
                const json & sh = get_arr(rj, "shape", where);
                if (sh.size() != 3) {
                    throw std::runtime_error("manifest: " + r.tensor + " shape is not 3-D");
                }
                for (int d = 0; d < 3; ++d) {
                    if (!sh[d].is_number_integer() || sh[d].get<int64_t>() < 1 || sh[d].get<int64_t>() > MAX_DIM) {
                        throw std::runtime_error("manifest: " + r.tensor + " shape " + sh.dump() + " is out of range");
                    }
                    r.ne[d] = sh[d].get<int64_t>();
                }
                r.offset = (uint64_t) get_int(rj, "offset", 0, MAX_OFFSET / MAX_EXPERTS, where);
                r.bytes = (uint64_t) get_int(rj, "bytes", 1, MAX_OFFSET / MAX_EXPERTS, where);
                id_layer["roles"].push_back({{"role", r.role}, {"tensor", r.tensor}, {"type", type_name},
                                             {"type_id", type_id}, {"shape", sh}, {"offset", r.offset},
                                             {"bytes", r.bytes}});
                l.roles.push_back(r);
            }
            const json & sums = get_arr(lj, "checksums", where);
            if ((int64_t) sums.size() != m.n_experts) {
                throw std::runtime_error("manifest: " + where + "has " + std::to_string(sums.size()) +
                                         " checksums for " + std::to_string(m.n_experts) + " experts");
            }
            for (const auto & c : sums) {
                if (!c.is_string()) {
                    throw std::runtime_error("manifest: " + where + "a checksum is not a string");
                }
                l.checksums.push_back(from_hex16(c.get<std::string>(), "a checksum of layer " + std::to_string(l.layer)));
            }
            identity["layers"].push_back(std::move(id_layer));
            m.layers.push_back(std::move(l));
        }
        identity_digest = canonical_digest(identity);
    } catch (const json::exception & e) {
        throw std::runtime_error("manifest " + path + " is malformed: " + e.what());
    }

    // fail closed on anything a reader would trip over (every value is bounded above, so nothing here overflows)
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
        uint64_t end = 0;
        for (const auto & r : l.roles) {
            if (r.ne[2] != m.n_experts || r.offset < end || r.ne[0] % ggml_blck_size(r.type) ||
                r.bytes != ggml_row_size(r.type, r.ne[0]) * (uint64_t) r.ne[1]) {
                throw std::runtime_error("manifest: " + where + " role " + r.role + " is inconsistent");
            }
            end = r.offset + r.bytes;
        }
        if (end > l.block_bytes) {
            throw std::runtime_error("manifest: " + where + " roles overflow the block");
        }
        expect = l.offset + l.expert_stride * (uint64_t) m.n_experts;
        if (expect > m.pack_size) {
            throw std::runtime_error("manifest: " + where + " ends past the pack's data region");
        }
    }
    if (expect != m.pack_size) {
        throw std::runtime_error("manifest: layers do not cover the pack's data region");
    }
    // last, so that a structural fault above is named as such
    if (identity_digest != m.pack_id) {
        throw std::runtime_error("manifest " + path + ": the layout does not match its pack_id");
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
