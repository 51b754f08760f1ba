// A provider's life: open a pack (manifest, pack header, I/O engine), attach to a model when it loads -- size each
// device's expert cache from its budget, allocate the arenas, staging buffers and host-RAM tier, preload the layers
// that fit whole -- and detach when the model goes.
#include "provider.h"

#include "memory_limit.h"
#include "read_pool.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

using namespace expert_pack;

void expert_pack_provider::open(const char * config_json) {
    cfg = parse_config(config_json ? config_json : "");
    ram_mode = ram_tier_mode::make(cfg.ram_tier_mode);
    man = load_manifest(cfg.manifest_path);
    io = std::make_unique<io_engine>(cfg.pack_path, cfg.direct_io, cfg.read_splits);
    reads = std::make_unique<read_pool>(*io, stats, cfg.read_threads);
    {
        host_memory header(nullptr, PACK_HEADER_SIZE, "pack header buffer", "");
        io->read(header.base(), 0, PACK_HEADER_SIZE);
        check_pack_header(header.base(), io->file_size(), man);
    }
    for (const auto & l : man.layers) {
        max_read = std::max(max_read, l.read_bytes);
    }
    ggml_init_params ip = {ggml_tensor_overhead() * (man.layers.size() * 4 + 8), nullptr, true};
    meta_ctx = ggml_init(ip);
    for (const auto & l : man.layers) {
        auto L = std::make_unique<expert_pack_layer>();
        L->owner = this;
        L->layout = &l;
        L->moe_index = (int32_t) (&l - man.layers.data());
        L->meta.assign(l.roles.size(), nullptr);
        for (size_t r = 0; r < l.roles.size(); ++r) {
            by_tensor[l.roles[r].tensor] = {L.get(), r};
        }
        layers[l.layer] = std::move(L);
    }
    for (auto & [il, L] : layers) {
        auto it = layers.find(il + 1);
        L->next = it == layers.end() ? nullptr : it->second.get();
    }
    if (!cfg.stats_path.empty()) {  // likewise the stats file: written now (zero counters), then while running
        if (!write_file_atomic(cfg.stats_path, stats_json(stats.snapshot(), stats, geometry_json()))) {
            throw std::runtime_error("expert_pack key 'stats_path': cannot write " + cfg.stats_path + ": " +
                                     strerror(errno));
        }
    }
    if (!cfg.trace_path.empty()) {  // a path we cannot write is a start-up error, not a silent no-trace
        trace = fopen(cfg.trace_path.c_str(), "wb");
        if (!trace) {
            throw std::runtime_error("expert_pack key 'trace_path': cannot create " + cfg.trace_path + ": " +
                                     strerror(errno));
        }
    }
}

expert_pack_provider::~expert_pack_provider() {
    detach();
    if (trace) fclose(trace);  // flushes the trace
    {
        for (auto & [_, l] : layers) {
            for (auto * t : l->meta) {
                if (t) unregister_tensor(t);
            }
        }
    }
    if (meta_ctx) ggml_free(meta_ctx);
}

void expert_pack_provider::detach() {
    pf.reset();   // before the RAM tier: its reads write into the tier's blocks
    for (auto & [_, l] : layers) {
        free_arena(l->arena);
        l->policy.reset();
        l->router = l->router_b = l->probs_b = nullptr;  // the model's tensors go with the model
        l->predicted.clear();
        l->stage = nullptr;
        l->resident = false;
        l->zero_slot = -1;
        l->distinct_ids = false;
        l->dev_stats = nullptr;
        l->rounds.clear();
    }
    ram.reset();  // before the stages: its blocks may wait on their copies
    stats.ram_blocks = 0;
    stats.ram_bytes = 0;
    stages.clear();  // (the devices' counters stay readable until the next attach, as the totals do)
    summary.clear();
    n_resident = 0;
    if (arena_ctx) {
        ggml_free(arena_ctx);
        arena_ctx = nullptr;
    }
    attached = false;
}

// The sizing rule: slots = floor(min(requested, free - reserve) / expert bytes), per device, the same count in every
// layer of a device. Throws std::runtime_error naming the cause (detached again).
void expert_pack_provider::attach(int n_layer, ggml_backend_dev_t const * layer_devs, int n_expert_used_) {
    try {
        detach();
        devices.clear();
        n_expert_used = n_expert_used_;
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        // the layers of each device share that device's budget, one slot count per device
        std::map<ggml_backend_dev_t, std::vector<expert_pack_layer *>> by_dev;
        for (auto & [il, L] : layers) {
            if (il >= n_layer) {
                throw std::runtime_error("the pack has experts for layer " + std::to_string(il) + ", the model has " +
                                         std::to_string(n_layer) + " layers (a pack of another model?)");
            }
            ggml_backend_dev_t dev = layer_devs && layer_devs[il] ? layer_devs[il] : cpu;
            by_dev[dev].push_back(L.get());
        }
        ggml_init_params ip = {ggml_tensor_overhead() * (layers.size() * 5 + 8), nullptr, true};
        arena_ctx = ggml_init(ip);
        const double MiB = 1024.0 * 1024.0;
        slots_min = INT32_MAX;
        std::string devices_summary;
        bool any_host_arena = false;
        for (auto & [dev, ls] : by_dev) {
            size_t free_mem = 0, total_mem = 0;
            std::string free_source = "free";
            const bool host = dev == cpu || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
            any_host_arena |= host;
            if (host) {
                // host memory: what the process can still take (MemAvailable, cgroup limits), not the machine's total
                const memory_headroom room = host_memory_headroom();
                if (room.bytes != UINT64_MAX) {
                    free_mem = (size_t) room.bytes;
                    free_source = room.source;
                }
            }
            if (free_mem == 0) {
                ggml_backend_dev_memory(dev, &free_mem, &total_mem);
                if (free_mem == 0 && total_mem == 0 && cpu) {
                    ggml_backend_dev_memory(cpu, &free_mem, &total_mem);
                }
            }
            const double reserve = cfg.cache_vram_reserve_mib * MiB;
            const double avail = std::max(0.0, (double) free_mem - reserve);
            const double budget = cfg.cache_vram_mib > 0 ? std::min(cfg.cache_vram_mib * MiB, avail) : avail;
            double per_slot = 0, fixed = 0;
            for (auto * L : ls) {
                per_slot += (double) slot_stride_for(*L->layout);
                fixed += (double) ARENA_TAIL_PAD;
            }
            // slots = floor(min(requested, free - reserve) / expert bytes), the same count in every layer
            // (the all-zero slot of a partial cache is counted as one more slot)
            int64_t slots = (int64_t) ((budget - fixed) / per_slot);
            if (slots < man.n_experts) {
                slots -= 1;
            }
            slots = std::min<int64_t>(slots, man.n_experts);
            if (slots < n_expert_used) {
                // the least budget that holds one token's experts (plus the all-zero slot unless that is every
                // expert), rounded up to the 0.1 MiB printed
                const int64_t need = n_expert_used < man.n_experts ? n_expert_used + 1 : n_expert_used;
                const double least_mib = std::ceil((per_slot * need + fixed) / MiB * 10) / 10;
                char buf[512];
                snprintf(buf, sizeof(buf),
                         "expert cache too small on %s: %.1f MiB (cache_vram_mib %.1f, %s %.0f MiB - reserve %.0f MiB) "
                         "holds %lld slot(s) per layer for %zu layers of %.2f MiB experts; one token needs %d experts "
                         "in each layer: at least %.1f MiB",
                         ggml_backend_dev_name(dev), budget / MiB, cfg.cache_vram_mib, free_source.c_str(),
                         free_mem / MiB, cfg.cache_vram_reserve_mib, (long long) std::max<int64_t>(slots, 0), ls.size(),
                         per_slot / ls.size() / MiB, n_expert_used, least_mib);
                throw std::runtime_error(buf);
            }
            ggml_backend_buffer_type_t buft = dev == cpu ? ggml_backend_cpu_buffer_type() : ggml_backend_dev_buffer_type(dev);
            stages.push_back(std::make_unique<staging>(dev, cfg.stage_slots, max_read));
            const bool all_fit = slots >= man.n_experts;
            devices.push_back(std::make_unique<device_counters>());
            device_counters & dc = *devices.back();
            dc.name = ggml_backend_dev_name(dev);
            dc.slots = (int32_t) slots;
            dc.n_layers = ls.size();
            for (auto * L : ls) {
                L->dev_stats = &dc;
                // a partial cache gets one extra, all-zero slot for rounds (inside the budget's tail padding)
                L->arena = alloc_arena(arena_ctx, buft, *L->layout, (int32_t) slots + (all_fit ? 0 : 1));
                L->zero_slot = all_fit ? -1 : (int32_t) slots;
                L->policy = std::make_unique<hybrid_policy>((int32_t) slots, man.n_experts);
                L->stage = stages.back().get();
                L->distinct_ids = !host;  // a GPU's mul_mat_id needs a token's slot ids distinct
                if (all_fit) {
                    preload(L);
                }
            }
            slots_min = std::min<int32_t>(slots_min, (int32_t) slots);
            uint64_t dev_bytes = 0;
            for (auto * L : ls) {
                dev_bytes += ggml_backend_buffer_get_size(L->arena.buffer);
                dc.n_resident += L->resident;
            }
            dc.cache_bytes = dev_bytes;
            char buf[512];
            snprintf(buf, sizeof(buf), "%s%s: %lld of %d experts x %zu layers = %.0f MiB (budget %s; %s %.0f MiB - "
                     "reserve %.0f MiB)", devices_summary.empty() ? "" : "; ", ggml_backend_dev_name(dev),
                     (long long) slots, man.n_experts, ls.size(), dev_bytes / MiB,
                     cfg.cache_vram_mib > 0 ? (std::to_string((long long) std::lround(cfg.cache_vram_mib)) +
                                                  " MiB asked").c_str() : "all that fits",
                     free_source.c_str(), free_mem / MiB, cfg.cache_vram_reserve_mib);
            devices_summary += buf;
        }
        // the host-RAM tier: one pool for all layers, blocks of the largest expert stride; only where some layer
        // can miss (resident layers never do)
        bool any_partial = false;
        for (auto & [_, L] : layers) {
            any_partial |= !L->resident;
        }
        uint64_t stride = 0;
        for (const auto & l : man.layers) {
            stride = std::max(stride, l.expert_stride);
        }
        double ram_mib = cfg.ram_cache_mib;
        std::string ram_how = "ram_cache_mib";
        if (ram_mib < 0) {
            // "auto": the sizing rule of docs/ARCHITECTURE.md with the process's own headroom as the limit: 80% of
            // what it can still take, less 4 GiB for the page cache and its later allocations (KV cache, compute
            // buffers); off when some MoE layer runs on the CPU (the cache itself is then host memory) or when every
            // layer is resident
            ram_mib = 0;
            ram_how = "auto";
            if (!any_host_arena && any_partial) {
                const memory_headroom room = host_memory_headroom();
                if (room.bytes != UINT64_MAX) {
                    ram_mib = std::max(0.0, 0.8 * (double) room.bytes / MiB - 4096.0);
                    ram_how = "auto: 80% of " + std::to_string((long long) (room.bytes / MiB)) + " MiB (" + room.source +
                              ") - 4096 MiB";
                }
            }
            if (ram_mib * MiB < (double) stride) {
                ram_mib = 0;
            }
        }
        if (ram_mib > 0 && any_partial) {
            const int64_t n_keys = (int64_t) man.layers.size() * man.n_experts;
            // more blocks than keys would never be used; the cap also keeps a huge value from overflowing
            const int64_t blocks = (int64_t) std::min<double>((double) n_keys, std::floor(ram_mib * MiB / stride));
            if (blocks < 1) {
                char buf[256];
                snprintf(buf, sizeof(buf), "expert_pack key 'ram_cache_mib' (%.3f) holds no expert block of %.2f MiB: "
                         "use at least %.2f, or 0 to turn the RAM tier off", ram_mib, stride / MiB, stride / MiB);
                throw std::runtime_error(buf);
            }
            // fail closed rather than swap or be OOM-killed later (pinned memory cannot be reclaimed, and counts
            // against a cgroup's memory.max)
            const memory_headroom room = host_memory_headroom();
            if ((uint64_t) blocks * stride > room.bytes) {
                char buf[512];
                snprintf(buf, sizeof(buf), "expert_pack key 'ram_cache_mib' asks for a host-RAM tier of %.1f MiB (%lld "
                         "blocks of %.2f MiB), but this process can take only %.1f MiB more (%s): lower it "
                         "(docs/ARCHITECTURE.md, \"Sizing the RAM tier\")", blocks * stride / MiB, (long long) blocks,
                         stride / MiB, room.bytes / MiB, room.source.c_str());
                throw std::runtime_error(buf);
            }
            ggml_backend_dev_t pin_dev = nullptr;  // pinned for the GPUs' copies when a GPU holds arenas
            for (auto & [dev, _] : by_dev) {
                if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                    pin_dev = dev;
                    break;
                }
            }
            ram = std::make_unique<ram_tier>(pin_dev, (int32_t) blocks, stride, (int32_t) n_keys, ram_mode->half_life());
            stats.ram_blocks = (uint64_t) blocks;
            stats.ram_bytes = ram->bytes();
            if (cfg.prefetch) {
                pf = std::make_unique<prefetch_blocks>(ram->policy(), stats, (int32_t) blocks, test_hold_prefetch);
            }
        }
        n_resident = 0;
        for (auto & [_, L] : layers) {
            n_resident += L->resident;
        }
        {
            char buf[256];
            if (ram) {
                snprintf(buf, sizeof(buf), "; host-RAM tier %.0f MiB (%lld blocks, %s, %s)", ram->bytes() / MiB,
                         (long long) stats.ram_blocks.load(), ram_mode->name(), ram_how.c_str());
            } else {
                snprintf(buf, sizeof(buf), "; no host-RAM tier%s", ram_how == "ram_cache_mib" ? "" : " (auto: off)");
            }
            summary = "expert pack: " + std::to_string(slots_min) + " of " + std::to_string(man.n_experts) +
                         " experts cached per MoE layer, " + std::to_string(n_resident) + " of " +
                         std::to_string(layers.size()) + " MoE layers resident; " + devices_summary + buf;
        }
        if (trace && !trace_header) {
            // "EPTRACE1", u32 version, u32 n_layers, u32 n_experts, u32 k (docs/FORMAT.md)
            const uint32_t h[4] = {1, (uint32_t) man.layers.size(), (uint32_t) man.n_experts,
                                   (uint32_t) n_expert_used};
            if (fwrite("EPTRACE1", 1, 8, trace) != 8 || fwrite(h, sizeof(h), 1, trace) != 1) {
                throw std::runtime_error("expert_pack key 'trace_path': cannot write " + cfg.trace_path + ": " +
                                         strerror(errno));
            }
            trace_header = true;
        }
        // without rounds, one step's distinct experts in a layer (<= k * n_tokens) must fit the layer's slots
        max_ubatch = slots_min >= man.n_experts || rounds_allowed
                      ? 0 : (uint32_t) (slots_min / std::max(1, n_expert_used));
        attached = true;
        last_layer = INT32_MAX;
    } catch (...) {
        detach();
        throw;
    }
}
