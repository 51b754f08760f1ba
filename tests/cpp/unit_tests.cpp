// Unit tests of the runtime's parts that need no model: the eviction policy, the RAM tier's modes, the I/O queue,
// the prefetch thread and its block states, the memory limit and the configuration. Built with the library
// (target expert-pack-unit-tests), registered with ctest, and run by tests/test_unit_cpp.py.
#include "cache_policy.h"
#include "config.h"
#include "io_engine.h"
#include "memory_limit.h"
#include "prefetch.h"
#include "prefetch_blocks.h"
#include "ram_tier_mode.h"
#include "read_pool.h"
#include "stats.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

using namespace expert_pack;

static int g_failed = 0, g_checks = 0;

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        ++g_checks;                                                                      \
        if (!(cond)) {                                                                   \
            ++g_failed;                                                                  \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);     \
        }                                                                                \
    } while (0)

template <class F> static std::string thrown(const F & f) {
    try {
        f();
    } catch (const std::exception & e) {
        return e.what();
    }
    return "";
}

// ---- the eviction policy ----------------------------------------------------------------------------------
static void test_policy() {
    std::vector<hybrid_policy::access> out;
    {
        hybrid_policy p(2, 8);
        CHECK(!p.step({0, 1, 2}, out));        // more distinct experts than slots: refused
        CHECK(p.slot_of(0) < 0);                // ... changing nothing
        CHECK(p.step({0, 1}, out) && !out[0].hit && !out[1].hit && out[0].evicted < 0);
        CHECK(p.step({0, 2}, out) && out[0].hit && !out[1].hit && out[1].evicted == 1);  // 0 is needed: 1 goes
    }
    {
        // frequency outlives a short absence: 0 is used every step, 1 once, 2 once more recently
        hybrid_policy p(2, 8);
        for (int i = 0; i < 6; ++i) p.step({0}, out);
        p.step({1}, out);
        p.step({2}, out);                       // evicts 1 (used once), not 0 (frequent)
        CHECK(p.slot_of(0) >= 0 && p.slot_of(1) < 0 && p.slot_of(2) >= 0);
    }
    {
        // never evicts what the step needs, whatever the scores
        hybrid_policy p(3, 16);
        for (int i = 0; i < 10; ++i) p.step({5, 6, 7}, out);
        CHECK(p.step({8, 9, 5}, out));
        std::set<int32_t> slots;
        for (const auto & a : out) slots.insert(a.slot);
        CHECK(slots.size() == 3 && p.slot_of(8) >= 0 && p.slot_of(9) >= 0 && p.slot_of(5) >= 0);
    }
    {
        hybrid_policy p(2, 8);
        p.step({0, 1}, out);
        const int32_t s0 = p.slot_of(0);
        p.invalidate(s0);                       // a failed load: the slot holds nothing
        CHECK(p.slot_of(0) < 0 && p.expert_in(s0) < 0);
        CHECK(p.step({3}, out) && out[0].slot == s0 && out[0].evicted < 0);  // a free slot beats any eviction
    }
    {
        // a busy slot (a read still writing it) is taken last
        hybrid_policy p(2, 8);
        p.step({0}, out);
        p.step({1}, out);
        p.set_busy(p.slot_of(0), true);         // 0 is the lower-ranked one
        p.step({2}, out);
        CHECK(p.slot_of(0) >= 0 && p.slot_of(1) < 0);
    }
    {
        // a prefetch (use = false) gains no frequency: a first-time guess is the next victim
        hybrid_policy p(2, 8);
        p.step({0}, out);
        p.step({1}, out, /*use=*/false);
        p.step({2}, out);
        CHECK(p.slot_of(1) < 0 && p.slot_of(0) >= 0);
    }
    {
        hybrid_policy p(2, 8);
        p.step({0, 1}, out);
        p.clear();
        CHECK(p.slot_of(0) < 0 && p.slot_of(1) < 0);
    }
}

// ---- the RAM tier's modes ---------------------------------------------------------------------------------
static void test_ram_tier_modes() {
    CHECK(std::string(ram_tier_mode::make("spill")->name()) == "spill");
    CHECK(std::string(ram_tier_mode::make("victim")->name()) == "victim");
    CHECK(std::string(ram_tier_mode::make("inclusive")->name()) == "inclusive");
    CHECK(!thrown([] { ram_tier_mode::make("lru"); }).empty());
    CHECK(ram_tier_mode::make("spill")->copies_back() && !ram_tier_mode::make("victim")->copies_back());
    CHECK(!ram_tier_mode::make("spill")->reads_are_uses() && ram_tier_mode::make("inclusive")->reads_are_uses());
    std::vector<hybrid_policy::access> out;
    {
        // victim: a block whose expert went onto the device is the first to go
        auto m = ram_tier_mode::make("victim");
        hybrid_policy tier(2, 8);
        tier.step({0}, out);
        tier.step({1}, out);
        m->on_device(tier, 1);                  // 1 is the more recent, but on the device now
        tier.step({2}, out);
        CHECK(tier.slot_of(1) < 0 && tier.slot_of(0) >= 0);
    }
    {
        // spill: a spare copy (weight 0) goes first; back to its popularity once the device evicts it
        auto m = ram_tier_mode::make("spill");
        hybrid_policy tier(2, 8, m->half_life());
        for (int i = 0; i < 4; ++i) m->selected(tier, 0);
        tier.step({0, 1}, out, m->reads_are_uses());
        m->selected(tier, 1);
        m->on_device(tier, 0);                  // 0 is popular but on the device
        tier.step({2}, out, m->reads_are_uses());
        CHECK(tier.slot_of(0) < 0 && tier.slot_of(1) >= 0);
    }
}

// ---- the I/O queue ----------------------------------------------------------------------------------------
static std::string temp_file(size_t n) {
    char path[] = "/tmp/ep-unit-XXXXXX";
    const int fd = mkstemp(path);
    std::vector<uint8_t> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = (uint8_t) (i * 131 + i / 4096);
    if (fd < 0 || write(fd, data.data(), n) != (ssize_t) n) throw std::runtime_error("cannot write a temp file");
    close(fd);
    return path;
}

static void test_io_queue() {
    const size_t block = 64 * 1024, n_blocks = 24;
    const std::string path = temp_file(block * n_blocks);
    for (int threads : {1, 4}) {
        io_engine io(path, /*direct=*/false, /*read_splits=*/1);
        counters stats;
        read_pool q(io, stats, threads);
        std::vector<std::vector<uint8_t>> bufs(n_blocks, std::vector<uint8_t>(block));
        std::atomic<int> landed{0};
        for (size_t j = 0; j < n_blocks; ++j) {
            read_request r;
            r.dst = bufs[j].data();
            r.offset = j * block;
            r.len = block;
            r.landed = [&landed] { ++landed; };
            q.submit(j, std::move(r));
        }
        std::set<size_t> tags;
        for (size_t j = 0; j < n_blocks; ++j) {
            auto [tag, err] = q.next();
            CHECK(!err);
            tags.insert(tag);
        }
        CHECK(tags.size() == n_blocks && !q.ready());  // every completion once
        CHECK(landed == (int) n_blocks);
        CHECK(stats.pack_read_bytes == block * n_blocks);
        bool same = true;
        for (size_t j = 0; j < n_blocks; ++j) {
            for (size_t i = 0; i < block; i += 997) {
                const size_t at = j * block + i;
                same &= bufs[j][i] == (uint8_t) (at * 131 + at / 4096);
            }
        }
        CHECK(same);
        // a failing landed step (a checksum mismatch) fails its own request only
        read_request bad;
        bad.dst = bufs[0].data();
        bad.len = block;
        bad.landed = [] { throw io_error("checksum mismatch"); };
        q.submit(7, std::move(bad));
        read_request good;
        good.dst = bufs[1].data();
        good.len = block;
        q.submit(8, std::move(good));
        int failed = 0, ok = 0;
        for (int i = 0; i < 2; ++i) {
            auto [tag, err] = q.next();
            failed += err && tag == 7;
            ok += !err && tag == 8;
        }
        CHECK(failed == 1 && ok == 1);
        // reading past the end is an io_error, never a short buffer
        read_request past;
        past.dst = bufs[0].data();
        past.offset = block * n_blocks - 4096;
        past.len = block;
        q.submit(9, std::move(past));
        CHECK(q.next().second != nullptr);
    }
    unlink(path.c_str());
}

// ---- prefetch: the thread and the block states ------------------------------------------------------------
static void test_prefetch() {
    {
        prefetcher pf(1);
        pf.hold(true);                           // nothing starts
        pf.submit(3, [] {});
        pf.submit(4, [] {});
        CHECK(pf.pending(3) && !pf.finished(3));
        CHECK(pf.cancel(3) && !pf.pending(3));
        const auto dropped = pf.cancel_queued();
        CHECK(dropped.size() == 1 && dropped[0] == 4);
        pf.hold(false);
        pf.submit(5, [] { throw io_error("EIO"); });
        CHECK(pf.wait(5) != nullptr && !pf.pending(5));  // the read's failure reaches whoever waits
        pf.submit(6, [] {});
        CHECK(pf.wait(6) == nullptr);
    }
    {
        counters stats;
        hybrid_policy tier(4, 16);
        std::vector<hybrid_policy::access> out;
        tier.step({1, 2, 3}, out, /*use=*/false);
        prefetch_blocks pb(tier, stats, 4, /*hold=*/true);
        pb.submit(out[0].slot, [] {});
        pb.submit(out[1].slot, [] {});
        CHECK(stats.prefetch_issued == 2);
        pb.settle();                             // held: both dropped before they started
        CHECK(stats.prefetch_cancelled == 2 && tier.slot_of(1) < 0 && tier.slot_of(2) < 0);
        pb.hold(false);
        const int32_t b = out[2].slot;
        pb.submit(b, [] {});
        CHECK(pb.wait(b) == nullptr);
        pb.used(b);                              // a step copies the guess
        pb.used(b);                              // ... counted once
        CHECK(stats.prefetch_used == 1);
        pb.submit(b, [] {});
        while (!pb.finished(b)) {}               // the read ran (one not started would be dropped: cancelled)
        pb.reclaim(b);                           // the block gets other content before any use: wasted
        CHECK(stats.prefetch_wasted == 1 && stats.prefetch_cancelled == 2 && !pb.pending(b));
        pb.hold(true);
        pb.submit(b, [] {});
        pb.reclaim(b);                           // not started: dropped, not wasted
        CHECK(stats.prefetch_cancelled == 3 && stats.prefetch_wasted == 1);
    }
}

// ---- the memory limit -------------------------------------------------------------------------------------
static void test_memory_limit() {
    setenv("EXPERT_PACK_TEST_MEM_AVAILABLE_MIB", "1234", 1);
    unsetenv("EXPERT_PACK_TEST_CGROUP_DIR");
    memory_headroom h = host_memory_headroom();
    CHECK(h.bytes <= 1234ull << 20);             // a cgroup limit of this machine may be lower
    char dir[] = "/tmp/ep-cg-XXXXXX";
    CHECK(mkdtemp(dir) != nullptr);
    auto put = [&](const char * name, const char * text) {
        FILE * f = fopen((std::string(dir) + "/" + name).c_str(), "w");
        fputs(text, f);
        fclose(f);
    };
    put("memory.max", "1073741824\n");           // 1 GiB
    put("memory.current", "805306368\n");        // 768 MiB used, 256 MiB of it reclaimable page cache
    put("memory.stat", "active_file 134217728\ninactive_file 134217728\n");
    setenv("EXPERT_PACK_TEST_CGROUP_DIR", dir, 1);
    h = host_memory_headroom();
    CHECK(h.bytes == 512ull << 20);              // 1024 - (768 - 256) MiB, below MemAvailable's 1234
    CHECK(h.source.find("memory.max") != std::string::npos);
    put("memory.max", "max\n");
    h = host_memory_headroom();
    CHECK(h.bytes == 1234ull << 20);             // no limit: MemAvailable
    unsetenv("EXPERT_PACK_TEST_CGROUP_DIR");
    unsetenv("EXPERT_PACK_TEST_MEM_AVAILABLE_MIB");
    for (const char * f : {"memory.max", "memory.current", "memory.stat"}) unlink((std::string(dir) + "/" + f).c_str());
    rmdir(dir);
}

// ---- the configuration ------------------------------------------------------------------------------------
static void test_config() {
    const std::string base = R"("pack_path": "p", "manifest_path": "m")";
    const config c = parse_config("{" + base + "}");
    CHECK(c.read_threads == 4 && c.read_splits == 1 && c.stage_slots == 4 && c.direct_io && c.verify_pack_sha256);
    CHECK(c.ram_tier_mode == "spill" && c.ram_cache_mib == 0 && !c.prefetch);
    CHECK(parse_config("{" + base + R"(, "cache_vram_mib": "8G"})").cache_vram_mib == 8192);
    CHECK(parse_config("{" + base + R"(, "ram_cache_mib": "auto"})").ram_cache_mib == -1);
    CHECK(thrown([&] { parse_config("{" + base + R"(, "read_thread": 2})"); }).find("read_thread") != std::string::npos);
    CHECK(thrown([&] { parse_config("{" + base + R"(, "read_threads": 0})"); }).find("read_threads") != std::string::npos);
    CHECK(thrown([&] { parse_config("{" + base + R"(, "ram_tier_mode": "lru"})"); }).find("ram_tier_mode") != std::string::npos);
    CHECK(thrown([&] { parse_config("{" + base + R"(, "cache_vram_mib": "8X"})"); }).find("cache_vram_mib") != std::string::npos);
    CHECK(!thrown([&] { parse_config("not json"); }).empty());
    // the configuration round-trips through its JSON
    const config d = parse_config("{" + base + R"(, "read_threads": 7, "prefetch": true, "ram_cache_mib": 64})");
    const std::string j = d.to_json();
    const config e = parse_config(j);
    CHECK(e.read_threads == 7 && e.prefetch && e.ram_cache_mib == 64 && e.to_json() == j);
}

int main() {
    test_policy();
    test_ram_tier_modes();
    test_io_queue();
    test_prefetch();
    test_memory_limit();
    test_config();
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed ? 1 : 0;
}
