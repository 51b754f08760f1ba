// Next-layer prefetch's RAM-tier blocks and their states (config key prefetch). At layer L the graph applies layer
// L + 1's router to L's router input; the provider places the predicted experts that are neither on L + 1's device
// nor in the tier into tier blocks (a guess only ever takes RAM-tier blocks, never a device slot, and gains no
// frequency there) and submits their reads here, which run on a thread of their own (prefetch.h) while the device
// computes L's experts and L + 1's attention. This class owns what each block's guess is doing:
//   unused  holds, or is reading, a guess no step has used yet (a hit on it counts prefetch_used; if the block gets
//           other content first, prefetch_wasted; if its read is dropped before it started, prefetch_cancelled)
//   busy    its read is submitted and not yet seen finished: the tier's policy takes another block rather than wait
//           for that read (a wrong guess is the tier's next victim, so without this the next layer's first RAM miss
//           would often take the block of the guess still being read, and wait for it)
// Demand first: at each layer's acquire every read not started yet is dropped before the layer reads anything
// itself (settle), so a prefetch only ever gains the time its read ran during the compute of the layers before.
// Output is never affected: a used prefetch is just a RAM hit.
#pragma once

#include "cache_policy.h"
#include "prefetch.h"
#include "stats.h"

#include <cstdint>
#include <exception>
#include <functional>
#include <vector>

namespace expert_pack {

class prefetch_blocks {
public:
    // `tier`: the RAM tier's policy, whose slots are the blocks
    prefetch_blocks(hybrid_policy & tier, counters & stats, int32_t n_blocks, bool hold);

    // Read a guess into block b (just placed there by the tier's policy, reclaimed, its copies complete).
    void submit(int32_t b, std::function<void()> read);
    // Whether block b has a read queued, running, or finished and not yet waited for.
    bool pending(int32_t b) { return threads_.pending(b); }
    // Whether block b's read has finished (wait() returns at once).
    bool finished(int32_t b) { return threads_.finished(b); }
    // Wait for block b's read, running or finished: its exception, null when it succeeded (counted in
    // prefetch_wait_ns). The block is not busy any more.
    std::exception_ptr wait(int32_t b);
    // Before block b gets other content: a read not yet started is dropped, one already running is waited for (its
    // content is discarded whatever the outcome), and a guess never used counts as wasted.
    void reclaim(int32_t b);
    // At a layer's acquire, before it reads anything: every read not started is dropped (its block holds nothing).
    void settle();
    // Blocks whose read has finished, been dropped or been collected are not busy any more.
    void refresh_busy();
    // A step copies block b (a RAM hit): a guess held there is used.
    void used(int32_t b);
    // Block b's read failed: it holds no guess.
    void failed(int32_t b) { unused_[b] = 0; }
    // Test seam: while held, no read starts (so every one of them is dropped).
    void hold(bool on) { threads_.hold(on); }

private:
    bool cancel(int32_t b);   // drop b's read if it has not started; false if there was none to drop
    void dropped(int32_t b);  // b's read was dropped before it started

    hybrid_policy & tier_;
    counters & stats_;
    std::vector<char> unused_;
    std::vector<int32_t> busy_;  // blocks marked busy in the tier's policy
    // one thread: a guess should be at most one read ahead of the demand reads it competes with (with 4, more
    // guesses had started before the next layer could drop them: 3.3x the wasted reads on the H200). Declared last:
    // destroyed first, so no read still runs when the states go.
    prefetcher threads_{1};
};

}  // namespace expert_pack
