// Whether a model file belongs to a pack, before llama.cpp's loader reads it: the pack's own trunk (its pack_id, and
// its size, tensor count and header checksum as the build recorded them), or the model the pack was built from (the
// source fingerprint over every shard), with the hyperparameters the pack depends on.
#include "provider.h"

#include "gguf.h"

#include <cmath>
#include <fstream>
#include <regex>
#include <stdexcept>

namespace expert_pack {

// The model's hyperparameters that the pack depends on, before llama.cpp's loader reads them (it asserts on some
// values instead of refusing them): the architecture, the expert count, top-k, and every epsilon finite and > 0.
static void check_hparams(const gguf_context * g, const manifest & m, const char * path) {
    const std::string file(path);
    const int64_t ka = gguf_find_key(g, "general.architecture");
    if (ka < 0 || gguf_get_kv_type(g, ka) != GGUF_TYPE_STRING) {
        throw std::runtime_error(file + " has no general.architecture");
    }
    const std::string arch = gguf_get_val_str(g, ka);
    if (arch != m.arch) {
        throw std::runtime_error(file + " is a " + arch + " model, the pack holds the experts of a " + m.arch + " model");
    }
    auto get_u = [&](const std::string & key, int64_t & out) {
        const int64_t k = gguf_find_key(g, key.c_str());
        if (k < 0) return false;
        switch (gguf_get_kv_type(g, k)) {
            case GGUF_TYPE_UINT8:  out = gguf_get_val_u8(g, k); return true;
            case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, k); return true;
            case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, k); return true;
            case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, k); return true;
            case GGUF_TYPE_UINT64: out = (int64_t) std::min<uint64_t>(gguf_get_val_u64(g, k), INT64_MAX); return true;
            case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, k); return true;
            default: throw std::runtime_error(file + ": " + key + " is not an integer");
        }
    };
    int64_t n_expert = -1, n_used = -1, n_layer = -1;
    if (!get_u(arch + ".expert_count", n_expert) || n_expert != m.n_experts) {
        throw std::runtime_error(file + ": " + arch + ".expert_count is " + (n_expert < 0 ? "missing" : std::to_string(n_expert)) +
                                 ", the pack has " + std::to_string(m.n_experts) + " experts per layer");
    }
    if (!get_u(arch + ".expert_used_count", n_used) || n_used < 1 || n_used > n_expert) {
        throw std::runtime_error(file + ": " + arch + ".expert_used_count is " +
                                 (n_used < 0 ? std::string("missing") : std::to_string(n_used)) + " (must be 1.." +
                                 std::to_string(n_expert) + ")");
    }
    if (!get_u(arch + ".block_count", n_layer) || n_layer < 1 || n_layer > 512) {  // llama.cpp's LLAMA_MAX_LAYERS
        throw std::runtime_error(file + ": " + arch + ".block_count is " +
                                 (n_layer < 0 ? std::string("missing") : std::to_string(n_layer)) + " (must be 1..512)");
    }
    {
        for (const auto & l : m.layers) {
            if (l.layer >= n_layer) {
                throw std::runtime_error(file + ": " + arch + ".block_count is " + std::to_string(n_layer) +
                                         ", the pack has experts for layer " + std::to_string(l.layer));
            }
        }
    }
    for (int64_t k = 0; k < gguf_get_n_kv(g); ++k) {
        const std::string key = gguf_get_key(g, k);
        if (key.size() > 7 && key.compare(key.size() - 7, 7, "epsilon") == 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_FLOAT32) {
            const float v = gguf_get_val_f32(g, k);
            if (!std::isfinite(v) || v <= 0) {
                throw std::runtime_error(file + ": " + key + " is " + std::to_string(v) + " (must be finite and > 0)");
            }
        }
    }
}

// A pack's own trunk, cheaply: its size, tensor count and the checksum of its header and KV region recorded by the
// build (the full checksum is `expert-pack verify`'s). A trunk edited or damaged after the build is refused here
// instead of tripping an assertion in llama.cpp's loader.
static void check_trunk(const manifest & m, const char * path, size_t data_offset, int64_t n_tensors) {
    const std::string file(path);
    std::ifstream f(file, std::ios::binary | std::ios::ate);
    const uint64_t size = f ? (uint64_t) f.tellg() : 0;
    if (size != m.trunk_size) {
        throw std::runtime_error(file + " is " + std::to_string(size) + " bytes, the pack's manifest says " +
                                 std::to_string(m.trunk_size) + (size < m.trunk_size ? " (truncated)" : " (modified)") +
                                 ": rebuild the pack or restore its trunk");
    }
    if (n_tensors != m.trunk_n_tensors) {
        throw std::runtime_error(file + " holds " + std::to_string(n_tensors) + " tensors, the pack's manifest says " +
                                 std::to_string(m.trunk_n_tensors) + " (a modified trunk)");
    }
    if (m.trunk_header_checksum.empty()) {
        return;
    }
    if (data_offset != m.trunk_header_size) {
        throw std::runtime_error(file + ": its header ends at " + std::to_string(data_offset) + ", the manifest says " +
                                 std::to_string(m.trunk_header_size) + " (a modified trunk)");
    }
    std::vector<char> head(m.trunk_header_size);
    f.seekg(0);
    if (!f.read(head.data(), (std::streamsize) head.size())) {
        throw std::runtime_error("cannot read the header of " + file);
    }
    uint8_t d[16];
    expert_pack_xxh3_128(head.data(), head.size(), d);
    if (to_hex(d, 16) != m.trunk_header_checksum) {
        throw std::runtime_error(file + ": its header and metadata were modified after the build (checksum " +
                                 to_hex(d, 16) + ", the manifest records " + m.trunk_header_checksum + ")");
    }
}

// XXH3-128 over each shard's header bytes [0, data_offset) followed by its size (docs/FORMAT.md)
static std::string source_fingerprint(const std::vector<std::string> & paths) {
    expert_pack_hasher * h = expert_pack_hasher_new();
    std::string err;
    for (const auto & path : paths) {
        gguf_init_params ip = {true, nullptr};
        gguf_context * g = gguf_init_from_file(path.c_str(), ip);
        if (!g) {
            err = "cannot read the GGUF header of " + path;
            break;
        }
        const size_t off = gguf_get_data_offset(g);
        gguf_free(g);
        std::ifstream f(path, std::ios::binary | std::ios::ate);
        const uint64_t size = (uint64_t) f.tellg();
        std::vector<char> head(off);
        f.seekg(0);
        f.read(head.data(), (std::streamsize) off);
        expert_pack_hasher_update(h, head.data(), off);
        expert_pack_hasher_update(h, &size, 8);
    }
    uint8_t d[16];
    expert_pack_hasher_digest(h, d);
    expert_pack_hasher_free(h);
    if (!err.empty()) {
        throw std::runtime_error(err);
    }
    return to_hex(d, 16);
}

void check_model_file(const manifest & man, const char * path) {
    gguf_init_params ip = {true, nullptr};
    gguf_context * g = gguf_init_from_file(path, ip);
    if (!g) {
        throw std::runtime_error(std::string("cannot read ") + path + " as GGUF");
    }
    std::string trunk_id;
    uint16_t n_split = 1;
    std::string hparams_error;
    try {
        if (int64_t k = gguf_find_key(g, "expert_pack.pack_id"); k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_STRING) {
            trunk_id = gguf_get_val_str(g, k);
        }
        if (int64_t k = gguf_find_key(g, "split.count"); k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_UINT16) {
            n_split = gguf_get_val_u16(g, k);
        }
        check_hparams(g, man, path);
    } catch (const std::exception & e) {
        hparams_error = e.what();
    }
    const size_t data_offset = gguf_get_data_offset(g);
    const int64_t n_tensors = gguf_get_n_tensors(g);
    gguf_free(g);
    if (!trunk_id.empty()) {
        if (trunk_id != man.pack_id) {
            throw std::runtime_error(std::string(path) + " is the trunk of another pack (pack_id " + trunk_id +
                                     "; the expert pack is " + man.pack_id + ")");
        }
        if (!hparams_error.empty()) {  // the specific cause first; the checksum would only say "modified"
            throw std::runtime_error(hparams_error);
        }
        check_trunk(man, path, data_offset, n_tensors);
        return;
    }
    if (!hparams_error.empty()) {
        throw std::runtime_error(hparams_error);
    }
    std::vector<std::string> paths = {path};
    if (n_split > 1) {
        std::smatch mt;
        const std::string s(path);
        static const std::regex re("^(.*)-00001-of-(\\d{5})\\.gguf$");
        if (!std::regex_match(s, mt, re)) {
            throw std::runtime_error(s + " declares " + std::to_string(n_split) + " shards but is not the first one");
        }
        for (int i = 1; i < n_split; ++i) {
            char buf[32];
            snprintf(buf, sizeof(buf), "-%05d-of-%05d.gguf", i + 1, (int) n_split);
            paths.push_back(mt[1].str() + buf);
        }
    }
    const std::string fp = source_fingerprint(paths);
    if (fp != man.source_fingerprint) {
        throw std::runtime_error(std::string(path) + " is not the model this pack was built from (source fingerprint " +
                                 fp + ", the pack's is " + man.source_fingerprint + ")");
    }
}

}  // namespace expert_pack
