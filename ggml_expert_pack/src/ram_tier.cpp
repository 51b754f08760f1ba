#include "ram_tier.h"

#include "manifest.h"

#include <stdexcept>

namespace expert_pack {

ram_tier::ram_tier(ggml_backend_dev_t dev, int32_t n_blocks, uint64_t block_bytes, int32_t n_keys, double half_life)
    : block_bytes_(block_bytes), policy_(n_blocks, n_keys, half_life), copies_(n_blocks) {
    if (n_blocks <= 0 || block_bytes == 0 || block_bytes % PACK_ALIGNMENT) {  // O_DIRECT reads land in blocks
        throw std::invalid_argument("ram tier: bad geometry");
    }
    mem_ = std::make_unique<host_memory>(dev, block_bytes * (uint64_t) n_blocks, "host-RAM tier memory", "ram_cache_mib");
}

void ram_tier::wait_copy(int32_t b) {
    copy & c = copies_[b];
    if (c.s) {
        c.s->wait(c.ticket);
        c = copy();
    }
}

}  // namespace expert_pack
