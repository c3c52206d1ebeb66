// The reference talker's "codec": a fixed seeded projection of a hidden state to 2048 codes.
//
//   u(k)    = ((splitmix64(0x7A1CE5 + (k + 1) * 0x9E3779B97F4A7C15) >> 11) * 2^-53) * 2 - 1
//   P[i][j] = float(u(i * 2048 + j))                        (a [hidden, 2048] float32 matrix)
//   frame   = argmax_j sum_i double(h[i]) * double(P[i][j])  (the first maximum wins)
//
// tests/talker_reference.py computes the same in numpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace talker {

constexpr int kNumCodes = 2048;
constexpr uint64_t kSeed = 0x7A1CE5ULL;

uint64_t SplitMix64(uint64_t x);

// u(k) in [-1, 1).
double Uniform(uint64_t k);

// The [hidden, kNumCodes] projection, row-major.
std::vector<float> MakeProjection(int64_t hidden);

// Projections by hidden size, each computed once (thread-safe).
class ProjectionCache {
 public:
  std::shared_ptr<const std::vector<float>> Get(int64_t hidden);

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<const std::vector<float>>> by_hidden_;
};

// The frame code of one hidden state (h.size() == hidden of `projection`).
int32_t CodecFrame(const std::vector<float>& h, const std::vector<float>& projection);

// zlib's CRC-32, chained: Crc32(data, n, Crc32(prev...)) == zlib.crc32(prev + data).
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

}  // namespace talker
