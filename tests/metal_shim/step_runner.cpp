// Runs a planned sequence of dispatches of the fused Metal step (src/engine/metal/step/plan.rs)
// under shim.h, on buffers written by the Rust test:
//   step_runner DIR OUT_ID...
// DIR holds buf_<id>.bin for every buffer and plan.txt, one dispatch a block:
//   D <kernel> <gx> <gy> <gz> <tx> <ty> <tz> <args>
//   B <slot> <buffer id> <byte offset>      (one line an argument, in slot order)
//   Y <slot> <hex bytes>                    (set_bytes)
// Each buffer OUT_ID is written back to out_<id>.bin after the last dispatch. Buffers are
// exactly sized vectors, so AddressSanitizer catches any access past one.
#include "shim.h"
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>

#define BOT_METAL_SHIM
#include "../../src/engine/metal/qmatmul.metal"
#include "../../src/engine/metal/step.metal"
#ifndef BOT_SHIM_STRICT
// kernels/sample.h is shared with CUDA and takes plain references: not part of the strict build
#include "../../src/engine/metal/sample.metal"
#endif

static std::vector<uchar> slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    if (!f) { std::fprintf(stderr, "cannot read %s\n", p.c_str()); std::exit(2); }
    return std::vector<uchar>(std::istreambuf_iterator<char>(f), {});
}

struct Dispatch {
    std::string name;
    uint3 grid, tg;
    std::vector<uchar*> slots;
};

// Every kernel's arguments from its slots, in the order of its [[buffer(i)]] attributes.
#define D(T, i) ((device T*)d.slots.at(i))
#define C(T, i) (*(constant T*)d.slots.at(i))
static void run(Dispatch& d) {
    std::function<void(const Lane&)> body;
    const std::string& k = d.name;
    if (k == "qmv4_step" || k == "qmvg_step" || k == "qmm_step") {
        auto f = k == "qmv4_step" ? qmv4_step : k == "qmvg_step" ? qmvg_step : qmm_step;
        body = [&, f](const Lane& l) {
            f(D(const float, 0), D(const uchar, 1), D(const uchar, 2), D(const uchar, 3), D(float, 4),
              C(MvParams, 5), D(const float, 6), D(const float, 7), D(const float, 8), D(const float, 9),
              D(const float, 10), D(float, 11), l.tgid, l.index, l.simd_gid, l.simd_lid);
        };
    } else if (k == "lora_a_step") {
        body = [&](const Lane& l) {
            lora_a_step(D(const float, 0), D(const float, 1), D(float, 2), C(LoraParams, 3), D(const float, 4),
                        l.tgid, l.simd_lid);
        };
    } else if (k == "qk_norm_rope_cache") {
        body = [&](const Lane& l) {
            qk_norm_rope_cache(D(float, 0), D(const float, 1), D(const float, 2), D(float, 3), D(float, 4),
                               D(const float, 5), D(const float, 6), C(AttnParams, 7), D(const float, 8),
                               D(const float, 9), l.tgid, l.index,
                               l.threads, l.simd_gid, l.simd_lid);
        };
    } else if (k == "attention_step") {
        body = [&](const Lane& l) {
            attention_step(D(const float, 0), D(const float, 1), D(const float, 2), D(float, 3), D(float, 4),
                           D(const float, 5), D(const float, 6), C(AttnParams, 7), D(float, 8),
                           D(const float, 9), D(const float, 10), l.tgid, l.index,
                           l.simd_gid, l.simd_lid);
        };
    } else if (k == "qgather") {
        body = [&](const Lane& l) {
            qgather(D(const uint, 0), D(const uchar, 1), D(const uchar, 2), D(const uchar, 3), D(float, 4),
                    C(QParams, 5), l.tgid, l.tid);
        };
#ifndef BOT_SHIM_STRICT
    } else if (k == "sample_f32") {
        body = [&](const Lane& l) {
            sample_f32(D(const float, 0), D(float, 1), C(SampleShape, 2), C(SampleParams, 3),
                       D(const SampleState, 4), D(uint, 5), D(uchar, 6), l.index, l.threads);
        };
#endif
    } else {
        std::fprintf(stderr, "unknown kernel %s\n", k.c_str());
        std::exit(2);
    }
    dispatch(d.grid, d.tg, body);
}

int main(int argc, char** argv) {
    if (argc < 2) { std::fprintf(stderr, "usage: step_runner DIR OUT_ID...\n"); return 2; }
    const std::string dir = argv[1];
    std::map<int, std::vector<uchar>> bufs;
    std::vector<std::vector<uchar>> bytes;  // set_bytes arguments (a moved vector keeps its data)
    auto buf = [&](int id) -> std::vector<uchar>& {
        auto it = bufs.find(id);
        if (it == bufs.end()) it = bufs.emplace(id, slurp(dir + "/buf_" + std::to_string(id) + ".bin")).first;
        return it->second;
    };
    std::ifstream plan(dir + "/plan.txt");
    std::string line;
    std::vector<Dispatch> ds;
    while (std::getline(plan, line)) {
        std::istringstream in(line);
        std::string tag;
        in >> tag;
        if (tag == "D") {
            Dispatch d;
            size_t n;
            in >> d.name >> d.grid.x >> d.grid.y >> d.grid.z >> d.tg.x >> d.tg.y >> d.tg.z >> n;
            d.slots.assign(n, nullptr);
            ds.push_back(d);
        } else if (tag == "B") {
            size_t slot, off;
            int id;
            in >> slot >> id >> off;
            auto& b = buf(id);
            if (off > b.size()) { std::fprintf(stderr, "offset past buffer %d\n", id); return 2; }
            ds.back().slots.at(slot) = b.data() + off;
        } else if (tag == "Y") {
            size_t slot;
            std::string hex;
            in >> slot >> hex;
            std::vector<uchar> v(hex.size() / 2);
            for (size_t i = 0; i < v.size(); i++) v[i] = (uchar)std::stoi(hex.substr(2 * i, 2), nullptr, 16);
            bytes.push_back(std::move(v));
            ds.back().slots.at(slot) = bytes.back().data();
        }
    }
    for (auto& d : ds) {
        for (size_t i = 0; i < d.slots.size(); i++)
            if (!d.slots[i]) { std::fprintf(stderr, "%s: slot %zu unbound\n", d.name.c_str(), i); return 2; }
        run(d);
    }
    for (int i = 2; i < argc; i++) {
        const int id = std::atoi(argv[i]);
        auto& b = buf(id);
        std::ofstream(dir + "/out_" + std::to_string(id) + ".bin", std::ios::binary)
            .write((const char*)b.data(), b.size());
    }
    return 0;
}
