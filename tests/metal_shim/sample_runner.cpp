// Runs metal/sample.metal's sample_f32 under shim.h on files written by the Rust test:
//   sample_runner DIR THREADS
// DIR holds x.bin (f32 logits), params.bin (SampleParams), state.bin (SampleState) and
// shape.bin (SampleShape); writes out.bin (three u32s) and keep.bin (a byte per token).
#include "shim.h"
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#define BOT_METAL_SHIM
#include "../../src/engine/metal/sample.metal"

static std::vector<uchar> slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    if (!f) { std::fprintf(stderr, "cannot read %s\n", p.c_str()); std::exit(2); }
    return std::vector<uchar>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
    if (argc != 3) { std::fprintf(stderr, "usage: sample_runner DIR THREADS\n"); return 2; }
    const std::string dir = argv[1];
    const uint nt = (uint)std::atoi(argv[2]);
    auto xb = slurp(dir + "/x.bin"), pb = slurp(dir + "/params.bin"), sb = slurp(dir + "/state.bin"),
         shb = slurp(dir + "/shape.bin");
    SampleParams p;
    SampleShape shape;
    std::memcpy(&p, pb.data(), sizeof p);
    std::memcpy(&shape, shb.data(), sizeof shape);
    if (sb.size() != sizeof(SampleState) || xb.size() != 4 * (size_t)shape.vocab) {
        std::fprintf(stderr, "state or logits of the wrong size\n");
        return 2;
    }
    std::vector<float> x(shape.vocab), work(shape.vocab, -12345.f);
    std::memcpy(x.data(), xb.data(), xb.size());
    std::vector<uint> out(3, 0xDEADBEEFu);
    std::vector<uchar> keep(shape.vocab, 2);  // 2: never written
    const SampleState* st = (const SampleState*)sb.data();
    dispatch({1, 1, 1}, {nt, 1, 1}, [&](const Lane& l) {
        sample_f32(x.data(), work.data(), shape, p, st, out.data(), keep.data(), l.tid.x, nt);
    });
    std::ofstream(dir + "/out.bin", std::ios::binary).write((const char*)out.data(), 12);
    std::ofstream(dir + "/keep.bin", std::ios::binary).write((const char*)keep.data(), keep.size());
    return 0;
}
