// llama_source.cpp -- the provider as llama.cpp's expert source (struct llama_expert_source_i, llama.h).
//
// The patched libllama reaches the provider only through this table (llama_model_params.expert_source, with the
// provider as expert_source_ctx), so it neither includes expert_pack.h nor links this library. Each member is
// our public C API: the table is independent of the provider's internals.
#include "expert_pack.h"

#include "ggml.h"
#include "llama.h"

namespace {

expert_pack_provider * P(void * ctx) {
    return static_cast<expert_pack_provider *>(ctx);
}

expert_pack_layer * L(void * layer) {
    return static_cast<expert_pack_layer *>(layer);
}

int check_model(void * ctx, const char * path, char * err, size_t err_len) {
    return expert_pack_check_model(P(ctx), path, err, err_len);
}

bool has_tensor(void * ctx, const char * name) {
    return expert_pack_has_tensor(P(ctx), name) != 0;
}

ggml_tensor * get_tensor(void * ctx, const char * name, int n_dims, const int64_t * ne, char * err, size_t err_len) {
    return expert_pack_tensor(P(ctx), name, n_dims, ne, err, err_len);
}

int attach(void * ctx, int32_t n_layer, ggml_backend_dev_t const * layer_devs, int32_t n_expert_used, bool expert_biases,
           char * err, size_t err_len) {
    if (expert_biases) {
        // per-expert biases would make a round's zero input produce non-zero outputs: no rounds, a ubatch cap
        expert_pack_disable_rounds(P(ctx));
    }
    return expert_pack_attach(P(ctx), n_layer, layer_devs, n_expert_used, err, err_len);
}

void set_router(void * ctx, int32_t il, ggml_tensor * gate_inp, ggml_tensor * gate_inp_b, ggml_tensor * exp_probs_b) {
    expert_pack_set_router(P(ctx), il, gate_inp, gate_inp_b, exp_probs_b);
}

void detach(void * ctx) {
    expert_pack_detach(P(ctx));
}

uint32_t max_ubatch(void * ctx) {
    return expert_pack_max_ubatch(P(ctx));
}

int32_t n_slots(void * ctx) {
    return expert_pack_slots_per_layer(P(ctx));
}

const char * step_done(void * ctx, int64_t n_tokens) {
    if (expert_pack_take_step_error(P(ctx))) {
        return expert_pack_last_error(P(ctx));  // a failed step is not counted
    }
    expert_pack_step_done(P(ctx), n_tokens);
    return nullptr;
}

void * layer(void * ctx, const ggml_tensor * t) {
    (void) ctx;  // the layer is found from the tensor alone
    return expert_pack_layer_of(t);
}

int32_t layer_rounds(void * layer, int64_t n_tokens) {
    return expert_pack_layer_resident(L(layer)) ? 0 : expert_pack_layer_rounds(L(layer), n_tokens);
}

ggml_tensor * layer_weights(void * layer, const ggml_tensor * t) {
    if (t == nullptr) {
        return nullptr;  // the layer has no such tensor (e.g. no gate in a merged gate_up layer)
    }
    ggml_tensor * a = expert_pack_layer_arena(L(layer), t);
    GGML_ASSERT(a != nullptr && "expert pack: a routed-expert tensor of this layer is not cached");
    return a;
}

void * layer_round(void * layer, int32_t round, int32_t n_rounds) {
    return expert_pack_layer_round(L(layer), round, n_rounds);
}

void * prefetch_target(void * layer, ggml_tensor ** gate_inp, ggml_tensor ** gate_inp_b, ggml_tensor ** exp_probs_b) {
    return expert_pack_layer_prefetch_target(L(layer), gate_inp, gate_inp_b, exp_probs_b);
}

const llama_expert_source_i k_source = {
    /* .check_model     = */ check_model,
    /* .has_tensor      = */ has_tensor,
    /* .get_tensor      = */ get_tensor,
    /* .attach          = */ attach,
    /* .set_router      = */ set_router,
    /* .detach          = */ detach,
    /* .max_ubatch      = */ max_ubatch,
    /* .n_slots         = */ n_slots,
    /* .step_done       = */ step_done,
    /* .layer           = */ layer,
    /* .layer_rounds    = */ layer_rounds,
    /* .layer_weights   = */ layer_weights,
    /* .layer_round     = */ layer_round,
    /* .acquire         = */ expert_pack_acquire,
    /* .round_mask      = */ expert_pack_round_mask,
    /* .prefetch_target = */ prefetch_target,
    /* .prefetch        = */ expert_pack_prefetch,
};

}  // namespace

extern "C" const llama_expert_source_i * expert_pack_llama_source(void) {
    return &k_source;
}
