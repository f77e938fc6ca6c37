// Runs one kernel of qmatmul.metal under shim.h on files written by the Rust test:
//   runner KERNEL DIR GX GY TX TY
// DIR holds params.bin (QParams), x.bin (f32, or u32 ids for qgather), w.bin, s.bin, b.bin;
// the result goes to y.bin (f32).
#include "shim.h"
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#define BOT_METAL_SHIM
#include "../../src/engine/metal/qmatmul.metal"

static std::vector<uchar> slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    if (!f) { std::fprintf(stderr, "cannot read %s\n", p.c_str()); std::exit(2); }
    return std::vector<uchar>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
    if (argc != 7) { std::fprintf(stderr, "usage: runner KERNEL DIR GX GY TX TY\n"); return 2; }
    const std::string k = argv[1], dir = argv[2];
    const uint3 grid{(uint)std::atoi(argv[3]), (uint)std::atoi(argv[4]), 1};
    const uint3 tg{(uint)std::atoi(argv[5]), (uint)std::atoi(argv[6]), 1};
    auto pb = slurp(dir + "/params.bin");
    QParams p;
    std::memcpy(&p, pb.data(), sizeof p);
    auto xb = slurp(dir + "/x.bin"), w = slurp(dir + "/w.bin"), s = slurp(dir + "/s.bin"), b = slurp(dir + "/b.bin");
    const size_t out_len = k == "qgather" ? (size_t)p.M * p.K : (size_t)p.M * p.N;
    std::vector<float> y(out_len, -12345.f);  // a sentinel: unwritten outputs show up
    const float* x = (const float*)xb.data();
    const uint* ids = (const uint*)xb.data();
    std::function<void(const Lane&)> body;
    if (k == "qmv_fast_4")
        body = [&](const Lane& l) { qmv_fast_4(x, w.data(), s.data(), b.data(), y.data(), p, l.tgid, l.simd_gid, l.simd_lid); };
    else if (k == "qmv_fast_8")
        body = [&](const Lane& l) { qmv_fast_8(x, w.data(), s.data(), b.data(), y.data(), p, l.tgid, l.simd_gid, l.simd_lid); };
    else if (k == "qmv_generic")
        body = [&](const Lane& l) { qmv_generic(x, w.data(), s.data(), b.data(), y.data(), p, l.tgid, l.simd_gid, l.simd_lid); };
    else if (k == "qmm")
        body = [&](const Lane& l) { qmm(x, w.data(), s.data(), b.data(), y.data(), p, l.tgid, l.tid); };
    else if (k == "qgather")
        body = [&](const Lane& l) { qgather(ids, w.data(), s.data(), b.data(), y.data(), p, l.tgid, l.tid); };
    else { std::fprintf(stderr, "unknown kernel %s\n", k.c_str()); return 2; }
    dispatch(grid, tg, body);
    std::ofstream o(dir + "/y.bin", std::ios::binary);
    o.write((const char*)y.data(), y.size() * sizeof(float));
    return 0;
}
