#include "codec.h"

#include <array>

namespace talker {

uint64_t SplitMix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

double Uniform(uint64_t k) {
  const uint64_t bits = SplitMix64(kSeed + (k + 1) * 0x9E3779B97F4A7C15ULL);
  return static_cast<double>(bits >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

std::vector<float> MakeProjection(int64_t hidden) {
  const size_t n = static_cast<size_t>(hidden) * kNumCodes;
  std::vector<float> p(n);
  for (size_t k = 0; k < n; ++k) p[k] = static_cast<float>(Uniform(k));
  return p;
}

std::shared_ptr<const std::vector<float>> ProjectionCache::Get(int64_t hidden) {
  std::lock_guard<std::mutex> lock(mu_);  // held while computing: one computation per size
  auto it = by_hidden_.find(hidden);
  if (it != by_hidden_.end()) return it->second;
  auto p = std::make_shared<const std::vector<float>>(MakeProjection(hidden));
  by_hidden_.emplace(hidden, p);
  return p;
}

int32_t CodecFrame(const std::vector<float>& h, const std::vector<float>& projection) {
  std::array<double, kNumCodes> scores{};
  for (size_t i = 0; i < h.size(); ++i) {
    const double hi = static_cast<double>(h[i]);
    const float* row = projection.data() + i * kNumCodes;
    for (int j = 0; j < kNumCodes; ++j) scores[j] += hi * static_cast<double>(row[j]);
  }
  int32_t best = 0;
  for (int j = 1; j < kNumCodes; ++j) {
    if (scores[j] > scores[best]) best = j;
  }
  return best;
}

namespace {

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  return table;
}

}  // namespace

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = MakeCrcTable();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

}  // namespace talker
