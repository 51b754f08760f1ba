#include "timeline.h"

#include <cstdio>

namespace expert_pack {

void step_timeline::new_step() {
    if (!cur_.empty()) {
        std::lock_guard<std::mutex> lk(mu_);
        last_.swap(cur_);
        last_done_ = done_;
        last_prev_done_ = prev_done_;
    }
    cur_.clear();
    prev_done_ = done_;
    done_ = 0;
}

step_timeline::layer_marks & step_timeline::begin_layer(int32_t layer, int32_t round) {
    cur_.emplace_back();
    layer_marks & m = cur_.back();
    m.layer = layer;
    m.round = round;
    m.start = now();
    return m;
}

std::string step_timeline::last_json() const {
    std::lock_guard<std::mutex> lk(mu_);
    if (last_.empty()) {
        return "{\"layers\":[]}";
    }
    const int64_t t0 = last_.front().start;
    auto us = [t0](int64_t t) { return t ? (double) (t - t0) / 1e3 : -1.0; };
    char buf[256];
    snprintf(buf, sizeof(buf), "{\"prev_done_us\":%.1f,\"done_us\":%.1f,\"layers\":[",
             last_prev_done_ ? us(last_prev_done_) : -1.0, us(last_done_));
    std::string s = buf;
    for (size_t i = 0; i < last_.size(); ++i) {
        const auto & l = last_[i];
        snprintf(buf, sizeof(buf), "%s{\"layer\":%d,\"round\":%d,\"start_us\":%.1f,\"plan_us\":%.1f,\"end_us\":%.1f,\"reads\":[",
                 i ? "," : "", l.layer, l.round, us(l.start), us(l.plan), us(l.end));
        s += buf;
        for (size_t j = 0; j < l.reads.size(); ++j) {
            const auto & r = l.reads[j];
            snprintf(buf, sizeof(buf), "%s{\"expert\":%d,\"issue_us\":%.1f,\"start_us\":%.1f,\"io_us\":%.1f,\"hash_us\":%.1f,"
                     "\"copy_us\":%.1f}", j ? "," : "", r.expert, us(r.issue), us(r.start), us(r.io), us(r.hash), us(r.copy));
            s += buf;
        }
        s += "]}";
    }
    return s + "]}";
}

}  // namespace expert_pack
