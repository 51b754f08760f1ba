#include "config.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <stdexcept>

namespace expert_pack {

using json = nlohmann::json;

static std::string shown(const json & v) {
    std::string s = v.dump();
    return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

[[noreturn]] static void bad(const std::string & key, const std::string & what, const json & v) {
    throw std::invalid_argument("expert_pack key '" + key + "' must be " + what + ", got " + shown(v));
}

static std::string get_string(const std::string & key, const json & v, bool non_empty) {
    if (!v.is_string() || (non_empty && v.get<std::string>().empty())) {
        bad(key, non_empty ? "a non-empty string" : "a string", v);
    }
    return v.get<std::string>();
}

// A size in MiB: a number, or a string with a binary unit ("512M", "8G", "1.5T", "65536K", "100" = MiB);
// `allow_auto` also takes "auto" (returned as -1: sized at attach).
static double get_size_mib(const std::string & key, const json & v, bool allow_auto) {
    const std::string want = std::string("a size in MiB (a number >= 0, or a string such as \"512M\", \"8G\"") +
                             (allow_auto ? " or \"auto\")" : ")");
    if (v.is_number() && !v.is_boolean()) {
        const double x = v.get<double>();
        if (!(x >= 0) || !std::isfinite(x)) bad(key, want, v);
        return x;
    }
    if (!v.is_string()) bad(key, want, v);
    std::string s = v.get<std::string>();
    while (!s.empty() && isspace((unsigned char) s.back())) s.pop_back();
    while (!s.empty() && isspace((unsigned char) s.front())) s.erase(s.begin());
    std::string lower;
    for (char ch : s) lower += (char) tolower((unsigned char) ch);
    if (allow_auto && lower == "auto") return -1;
    size_t used = 0;
    double x = 0;
    try {
        x = std::stod(lower, &used);
    } catch (const std::exception &) {
        bad(key, want, v);
    }
    std::string unit = lower.substr(used);
    while (!unit.empty() && isspace((unsigned char) unit.front())) unit.erase(unit.begin());
    double scale = 0;  // to MiB
    if (unit.empty() || unit == "m" || unit == "mb" || unit == "mib") scale = 1;
    else if (unit == "k" || unit == "kb" || unit == "kib") scale = 1.0 / 1024;
    else if (unit == "g" || unit == "gb" || unit == "gib") scale = 1024;
    else if (unit == "t" || unit == "tb" || unit == "tib") scale = 1024.0 * 1024;
    if (scale == 0 || !(x >= 0) || !std::isfinite(x)) bad(key, want, v);
    return x * scale;
}

static int32_t get_int(const std::string & key, const json & v, int32_t min, int32_t max) {
    if (!v.is_number_integer() || v.get<int64_t>() < min || v.get<int64_t>() > max) {
        bad(key, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]", v);
    }
    return (int32_t) v.get<int64_t>();
}

static bool get_bool(const std::string & key, const json & v) {
    if (!v.is_boolean()) {
        bad(key, "true or false", v);
    }
    return v.get<bool>();
}

// The keys: the one description of the configuration. The parser dispatches on it, and expert_pack_config_schema
// hands it to the other surfaces (the Python binding, serve's flags, the fork's flags, the docs' table), whose tests
// compare themselves with it.
namespace {

struct key_spec {
    const char * name;
    const char * type;     // path, string, size, size_or_auto, int, bool, enum
    const char * def;      // the default as JSON
    int32_t lo, hi;        // int: the range
    const char * values;   // enum: the accepted values, "|"-separated
    const char * help;
    void (*set)(config & c, const key_spec & k, const json & v);
};

const key_spec KEYS[] = {
    {"pack_path", "path", "\"\"", 0, 0, "", "experts.pack (the Python API and the tools derive it from the pack folder)",
     [](config & c, const key_spec & k, const json & v) { c.pack_path = get_string(k.name, v, true); }},
    {"manifest_path", "path", "\"\"", 0, 0, "", "manifest.json (derived from the pack folder likewise)",
     [](config & c, const key_spec & k, const json & v) { c.manifest_path = get_string(k.name, v, true); }},
    {"cache_vram_mib", "size", "0", 0, 0, "", "the expert cache's budget on each device, MiB; 0 = all that fits",
     [](config & c, const key_spec & k, const json & v) { c.cache_vram_mib = get_size_mib(k.name, v, false); }},
    {"cache_vram_reserve_mib", "size", "1024", 0, 0, "", "left free on each device, MiB",
     [](config & c, const key_spec & k, const json & v) { c.cache_vram_reserve_mib = get_size_mib(k.name, v, false); }},
    {"stage_slots", "int", "4", 1, 1024, "", "staging buffers (pinned on a GPU)",
     [](config & c, const key_spec & k, const json & v) { c.stage_slots = get_int(k.name, v, k.lo, k.hi); }},
    {"read_splits", "int", "1", 1, 64, "", "reads per expert block (> 1 through staging: the chunked miss path)",
     [](config & c, const key_spec & k, const json & v) { c.read_splits = get_int(k.name, v, k.lo, k.hi); }},
    {"read_threads", "int", "4", 1, 64, "", "threads reading one step's misses concurrently",
     [](config & c, const key_spec & k, const json & v) { c.read_threads = get_int(k.name, v, k.lo, k.hi); }},
    {"direct_io", "bool", "true", 0, 0, "", "O_DIRECT reads; false = buffered, for comparison only",
     [](config & c, const key_spec & k, const json & v) { c.direct_io = get_bool(k.name, v); }},
    {"stats_path", "string", "\"\"", 0, 0, "", "the stats JSON, written every stats_flush_interval steps; \"\" = none",
     [](config & c, const key_spec & k, const json & v) { c.stats_path = get_string(k.name, v, false); }},
    {"stats_flush_interval", "int", "64", 1, 1 << 30, "", "steps between writes of the stats file",
     [](config & c, const key_spec & k, const json & v) { c.stats_flush_interval = get_int(k.name, v, k.lo, k.hi); }},
    {"verify_pack_sha256", "bool", "true", 0, 0, "", "check each block's XXH3-128 as it is read",
     [](config & c, const key_spec & k, const json & v) { c.verify_pack_sha256 = get_bool(k.name, v); }},
    {"ram_cache_mib", "size_or_auto", "0", 0, 0, "", "the host-RAM tier, MiB; 0 = off; \"auto\" = sized at load",
     [](config & c, const key_spec & k, const json & v) { c.ram_cache_mib = get_size_mib(k.name, v, true); }},
    {"trace_path", "string", "\"\"", 0, 0, "", "record the router's expert ids per step and layer; \"\" = off",
     [](config & c, const key_spec & k, const json & v) { c.trace_path = get_string(k.name, v, false); }},
    {"ram_tier_mode", "enum", "\"spill\"", 0, 0, "spill|victim|inclusive", "what the RAM tier keeps",
     [](config & c, const key_spec & k, const json & v) {
         c.ram_tier_mode = get_string(k.name, v, true);
         if (c.ram_tier_mode != "spill" && c.ram_tier_mode != "victim" && c.ram_tier_mode != "inclusive") {
             throw std::invalid_argument("expert_pack key 'ram_tier_mode' must be \"spill\", \"victim\" or "
                                         "\"inclusive\", got \"" + c.ram_tier_mode + "\"");
         }
     }},
    {"prefetch", "bool", "false", 0, 0, "", "read the next layer's predicted experts into the RAM tier (needs ram_cache_mib)",
     [](config & c, const key_spec & k, const json & v) { c.prefetch = get_bool(k.name, v); }},
};

}  // namespace

config parse_config(const std::string & json_text) {
    json j;
    try {
        j = json::parse(json_text);
    } catch (const json::parse_error & e) {
        throw std::invalid_argument(std::string("expert_pack configuration is not valid JSON: ") + e.what());
    }
    if (!j.is_object()) {
        throw std::invalid_argument("expert_pack configuration must be a JSON object");
    }
    config c;
    for (const auto & [key, v] : j.items()) {
        const key_spec * spec = nullptr;
        for (const auto & k : KEYS) {
            if (key == k.name) spec = &k;
        }
        if (!spec) {
            throw std::invalid_argument("unknown expert_pack key '" + key + "'");
        }
        spec->set(c, *spec, v);
    }
    if (c.prefetch && c.ram_cache_mib == 0) {
        throw std::invalid_argument("expert_pack key 'prefetch' needs the host-RAM tier: prefetched experts land in its "
                                    "blocks (set ram_cache_mib)");
    }
    if (c.pack_path.empty()) {
        throw std::invalid_argument("expert_pack key 'pack_path' is required");
    }
    if (c.manifest_path.empty()) {
        throw std::invalid_argument("expert_pack key 'manifest_path' is required");
    }
    return c;
}

std::string config_schema_json() {
    json out = json::array();
    for (const auto & k : KEYS) {
        json e = {{"name", k.name}, {"type", k.type}, {"default", json::parse(k.def)}, {"help", k.help}};
        if (std::string(k.type) == "int") {
            e["min"] = k.lo;
            e["max"] = k.hi;
        }
        if (*k.values) {
            json vals = json::array();
            std::string rest = k.values;
            for (size_t at; (at = rest.find('|')) != std::string::npos; rest = rest.substr(at + 1)) vals.push_back(rest.substr(0, at));
            vals.push_back(rest);
            e["values"] = vals;
        }
        out.push_back(e);
    }
    return out.dump();
}

std::string config::to_json() const {
    return json{
        {"pack_path", pack_path}, {"manifest_path", manifest_path}, {"cache_vram_mib", cache_vram_mib},
        {"cache_vram_reserve_mib", cache_vram_reserve_mib}, {"stage_slots", stage_slots},
        {"read_splits", read_splits}, {"read_threads", read_threads}, {"direct_io", direct_io}, {"stats_path", stats_path},
        {"stats_flush_interval", stats_flush_interval}, {"verify_pack_sha256", verify_pack_sha256},
        {"ram_cache_mib", ram_cache_mib}, {"trace_path", trace_path}, {"ram_tier_mode", ram_tier_mode},
        {"prefetch", prefetch},
    }.dump();
}

}  // namespace expert_pack
