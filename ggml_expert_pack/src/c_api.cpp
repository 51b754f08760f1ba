// The C API (expert_pack.h): handles, error buffers and the graph ops' entry points over the provider (provider.h).
// Every function that can fail returns an error code and fills the caller's buffer; no exception crosses it.
#include "provider.h"

#include "config.h"

#include <cstring>
#include <memory>
#include <stdexcept>

using namespace expert_pack;

extern "C" int expert_pack_config_validate(const char * config_json, char * err, size_t err_len) {
    try {
        parse_config(config_json ? config_json : "");
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return -1;
    }
}

extern "C" size_t expert_pack_config_schema(char * buf, size_t len) {
    const std::string s = config_schema_json();
    if (buf && len > s.size()) {
        memcpy(buf, s.c_str(), s.size() + 1);
    }
    return s.size();
}

extern "C" expert_pack_provider * expert_pack_open(const char * config_json, char * err, size_t err_len) {
    try {
        auto p = std::make_unique<expert_pack_provider>();
        p->open(config_json);
        return p.release();
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        return nullptr;
    }
}

extern "C" void expert_pack_free(expert_pack_provider * p) {
    if (p) {
        p->flush_stats();
        delete p;
    }
}

extern "C" void expert_pack_get_stats(const expert_pack_provider * p, expert_pack_stats * out) {
    *out = p->stats.snapshot();
}

extern "C" void expert_pack_reset_stats(expert_pack_provider * p) {
    p->stats.reset();
    for (auto & d : p->devices) {
        d->reset();
    }
}

extern "C" void expert_pack_reset_cache(expert_pack_provider * p) {
    for (auto & [_, l] : p->layers) {
        if (l->policy) l->policy->clear();
    }
    if (p->ram) {
        p->ram_mode->devices_cleared(p->ram->policy(), (int32_t) (p->man.layers.size() * p->man.n_experts));
    }
}

extern "C" size_t expert_pack_stats_json(const expert_pack_provider * p, char * buf, size_t len) {
    const std::string s = stats_json(p->stats.snapshot(), p->stats, p->geometry_json());
    if (buf && len > s.size()) {
        memcpy(buf, s.c_str(), s.size() + 1);
    }
    return s.size();
}

extern "C" const char * expert_pack_last_error(const expert_pack_provider * p) {
    return p->last_error.c_str();
}

extern "C" int32_t expert_pack_slots_per_layer(const expert_pack_provider * p) {
    return p->slots_min;
}

extern "C" uint32_t expert_pack_max_ubatch(const expert_pack_provider * p) {
    return p->max_ubatch;
}

extern "C" size_t expert_pack_summary(const expert_pack_provider * p, char * buf, size_t len) {
    if (buf && len > p->summary.size()) {
        memcpy(buf, p->summary.c_str(), p->summary.size() + 1);
    }
    return p->summary.size();
}

extern "C" size_t expert_pack_timeline_json(const expert_pack_provider * p, char * buf, size_t len) {
    const std::string s = p->timeline.last_json();
    if (buf && len > s.size()) {
        memcpy(buf, s.c_str(), s.size() + 1);
    }
    return s.size();
}

extern "C" void expert_pack_step_done(expert_pack_provider * p, int64_t n_tokens) {
    if (!p->attached) {
        return;
    }
    p->timeline.step_done();
    if (p->n_resident > 0 && n_tokens > 0) {
        const int64_t per_layer = std::min<int64_t>(p->man.n_experts, (int64_t) p->n_expert_used * n_tokens);
        p->stats.cache_hits += (uint64_t) per_layer * p->n_resident;
        for (auto & d : p->devices) {
            d->cache_hits += (uint64_t) per_layer * d->n_resident;
        }
    }
    if (!p->acquired) {
        p->count_step();
    }
    p->acquired = false;
}

extern "C" int expert_pack_check_model(expert_pack_provider * p, const char * path, char * err, size_t err_len) {
    try {
        check_model_file(p->man, path);
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        std::lock_guard<std::mutex> lk(p->err_mu);
        p->last_error = e.what();
        return -1;
    }
}

extern "C" const char * expert_pack_id(const expert_pack_provider * p) {
    return p->man.pack_id.c_str();
}

extern "C" int expert_pack_has_tensor(const expert_pack_provider * p, const char * name) {
    return p->by_tensor.count(name) ? 1 : 0;
}

extern "C" ggml_tensor * expert_pack_tensor(expert_pack_provider * p, const char * name, int n_dims, const int64_t * ne,
                                            char * err, size_t err_len) {
    auto it = p->by_tensor.find(name);
    if (it == p->by_tensor.end()) {
        set_err(err, err_len, std::string(name) + " is not in the expert pack");
        return nullptr;
    }
    auto [L, r] = it->second;
    const role_layout & role = L->layout->roles[r];
    if (n_dims != 3 || ne[0] != role.ne[0] || ne[1] != role.ne[1] || ne[2] != role.ne[2]) {
        char buf[256];
        snprintf(buf, sizeof(buf), "%s: the model expects {%lld, %lld, %lld}, the pack holds {%lld, %lld, %lld}",
                 name, (long long) (n_dims > 0 ? ne[0] : 0), (long long) (n_dims > 1 ? ne[1] : 0),
                 (long long) (n_dims > 2 ? ne[2] : 0), (long long) role.ne[0], (long long) role.ne[1],
                 (long long) role.ne[2]);
        set_err(err, err_len, buf);
        return nullptr;
    }
    if (!L->meta[r]) {
        ggml_tensor * t = ggml_new_tensor_3d(p->meta_ctx, role.type, role.ne[0], role.ne[1], role.ne[2]);
        ggml_set_name(t, name);
        L->meta[r] = t;
        register_tensor(t, L);
    }
    return L->meta[r];
}

extern "C" int expert_pack_attach(expert_pack_provider * p, int n_layer, ggml_backend_device * const * layer_devs,
                                  int n_expert_used, char * err, size_t err_len) {
    try {
        p->attach(n_layer, layer_devs, n_expert_used);
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
        std::lock_guard<std::mutex> lk(p->err_mu);
        p->last_error = e.what();  // llama.cpp only logs it; Python reads it here after a failed load
        return -1;
    }
}

extern "C" void expert_pack_detach(expert_pack_provider * p) {
    p->detach();
}

extern "C" expert_pack_layer * expert_pack_layer_of(const ggml_tensor * t) {
    return layer_of_tensor(t);
}

extern "C" int expert_pack_layer_resident(const expert_pack_layer * l) {
    return l->resident ? 1 : 0;
}

extern "C" ggml_tensor * expert_pack_layer_arena(expert_pack_layer * l, const ggml_tensor * t) {
    for (size_t r = 0; r < l->meta.size(); ++r) {
        if (l->meta[r] == t) {
            return r < l->arena.roles.size() ? l->arena.roles[r] : nullptr;
        }
    }
    return nullptr;
}

extern "C" int32_t expert_pack_layer_rounds(expert_pack_layer * l, int64_t n_tokens) {
    const expert_pack_provider * p = l->owner;
    if (!l->policy || l->resident || !p->rounds_allowed) {
        return 1;
    }
    const int64_t needed = std::min<int64_t>(p->man.n_experts, (int64_t) p->n_expert_used * n_tokens);
    const int64_t slots = l->policy->n_slots();
    return (int32_t) std::max<int64_t>(1, (needed + slots - 1) / slots);
}

extern "C" void * expert_pack_layer_round(expert_pack_layer * l, int32_t round, int32_t n_rounds) {
    auto & r = l->rounds[{round, n_rounds}];
    if (!r) {
        r = std::make_unique<expert_pack_round>(expert_pack_round{l, round, n_rounds});
    }
    return r.get();
}

extern "C" void expert_pack_disable_rounds(expert_pack_provider * p) {
    p->rounds_allowed = false;
    if (p->attached) {
        p->max_ubatch = p->slots_min >= p->man.n_experts ? 0 : (uint32_t) (p->slots_min / std::max(1, p->n_expert_used));
    }
}

extern "C" void expert_pack_acquire(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {  // every CPU thread runs every node; one does the work, the others wait at the barrier
        return;
    }
    auto * r = (expert_pack_round *) userdata;
    r->layer->owner->acquire(r->layer, r->index, r->count, dst, r->count > 1 ? &r->mask : nullptr);
}

extern "C" void expert_pack_round_mask(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto * r = (const expert_pack_round *) userdata;
    float * out = (float *) dst->data;
    const size_t n = (size_t) ggml_nelements(dst);
    for (size_t i = 0; i < n; ++i) {
        out[i] = i < r->mask.size() ? r->mask[i] : 0.0f;  // a failed round serves nothing
    }
}

extern "C" void expert_pack_set_router(expert_pack_provider * p, int il, ggml_tensor * gate_inp, ggml_tensor * gate_inp_b,
                                       ggml_tensor * exp_probs_b) {
    auto it = p->layers.find(il);
    if (it == p->layers.end()) {
        return;
    }
    it->second->router = gate_inp;
    it->second->router_b = gate_inp_b;
    it->second->probs_b = exp_probs_b;
}

extern "C" expert_pack_layer * expert_pack_layer_prefetch_target(expert_pack_layer * l, ggml_tensor ** gate_inp,
                                                                ggml_tensor ** gate_inp_b, ggml_tensor ** exp_probs_b) {
    expert_pack_layer * n = l->next;
    if (!l->owner->pf || !n || !n->policy || n->resident || !n->router) {
        return nullptr;
    }
    *gate_inp = n->router;
    *gate_inp_b = n->router_b;
    *exp_probs_b = n->probs_b;
    return n;
}

extern "C" void expert_pack_prefetch(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * n = (expert_pack_layer *) userdata;
    n->owner->prefetch(n, dst->src[0]);
}

extern "C" void expert_pack_test_distinct_round_slots(expert_pack_provider * p, int on) {
    p->test_distinct_slots = on != 0;
}

extern "C" void expert_pack_test_hold_prefetch(expert_pack_provider * p, int on) {
    p->test_hold_prefetch = on != 0;
    if (p->pf) p->pf->hold(p->test_hold_prefetch);
}

extern "C" void expert_pack_test_inject_eio(expert_pack_provider * p, int64_t n) {
    p->io->inject_eio_after(n);
}

extern "C" int expert_pack_take_step_error(expert_pack_provider * p) {
    std::lock_guard<std::mutex> lk(p->err_mu);
    const bool f = p->failure_pending;
    p->failure_pending = false;
    return f ? 1 : 0;
}

// ---- the policy on its own ----------------------------------------------------------------------------------

struct expert_pack_policy {
    hybrid_policy policy;
    int32_t n_experts;
    std::vector<hybrid_policy::access> plan;
};

extern "C" expert_pack_policy * expert_pack_policy_new(int32_t n_slots, int32_t n_experts) {
    if (n_slots <= 0 || n_experts <= 0) {
        return nullptr;
    }
    return new expert_pack_policy{hybrid_policy(n_slots, n_experts), n_experts, {}};
}

extern "C" int expert_pack_policy_step(expert_pack_policy * pol, const int32_t * experts, int32_t n, int32_t * slots_out,
                                       uint64_t * hits, uint64_t * misses, uint64_t * evictions) {
    std::vector<int32_t> unique;
    std::vector<char> seen(pol->n_experts, 0);
    for (int32_t i = 0; i < n; ++i) {
        if (experts[i] < 0 || experts[i] >= pol->n_experts) {
            return -1;
        }
        if (!seen[experts[i]]) {
            seen[experts[i]] = 1;
            unique.push_back(experts[i]);
        }
    }
    if (!pol->policy.step(unique, pol->plan)) {
        return -1;
    }
    for (const auto & a : pol->plan) {
        *hits += a.hit;
        *misses += !a.hit;
        *evictions += !a.hit && a.evicted >= 0;
    }
    for (int32_t i = 0; i < n; ++i) {
        slots_out[i] = pol->policy.slot_of(experts[i]);
    }
    return 0;
}

extern "C" void expert_pack_policy_set_busy(expert_pack_policy * pol, int32_t slot, int busy) {
    if (slot >= 0 && slot < pol->policy.n_slots()) {
        pol->policy.set_busy(slot, busy != 0);
    }
}

extern "C" void expert_pack_policy_free(expert_pack_policy * pol) {
    delete pol;
}
