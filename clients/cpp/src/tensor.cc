#include "llmstage/tensor.h"

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace llmstage {
namespace {

uint16_t Load16(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint16_t>(b[0] | (b[1] << 8));
}

uint32_t Load32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
         (static_cast<uint32_t>(b[2]) << 16) | (static_cast<uint32_t>(b[3]) << 24);
}

float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Decodes `count` elements starting at element `first` of the tensor's data.
std::vector<float> DecodeRange(const v1::Tensor& tensor, int64_t first, int64_t count) {
  const int64_t item = ItemSize(tensor.dtype());
  const std::string& data = tensor.data();
  const char* base = data.data() + first * item;
  std::vector<float> out(static_cast<size_t>(count));
  switch (tensor.dtype()) {
    case v1::DTYPE_FLOAT32:
      for (int64_t i = 0; i < count; ++i) out[i] = BitsToFloat(Load32(base + 4 * i));
      break;
    case v1::DTYPE_FLOAT16:
      for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(Load16(base + 2 * i));
      break;
    case v1::DTYPE_BFLOAT16:
      for (int64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(Load16(base + 2 * i));
      break;
    default:
      break;  // rejected by CheckFloatTensor
  }
  return out;
}

// Validates dtype and byte length; returns prod(shape).
int64_t CheckFloatTensor(const v1::Tensor& tensor) {
  const v1::DType dtype = tensor.dtype();
  if (dtype != v1::DTYPE_FLOAT32 && dtype != v1::DTYPE_FLOAT16 && dtype != v1::DTYPE_BFLOAT16) {
    throw std::invalid_argument("tensor dtype " + v1::DType_Name(dtype) +
                                " is not a float type (FLOAT32, FLOAT16, BFLOAT16)");
  }
  const int64_t n = NumElements(tensor);
  const int64_t want = n * ItemSize(dtype);
  if (static_cast<int64_t>(tensor.data().size()) != want) {
    throw std::invalid_argument("tensor data holds " + std::to_string(tensor.data().size()) +
                                " bytes; its shape and dtype need " + std::to_string(want));
  }
  return n;
}

}  // namespace

int64_t ItemSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return 4;
    case v1::DTYPE_FLOAT16: return 2;
    case v1::DTYPE_BFLOAT16: return 2;
    case v1::DTYPE_INT32: return 4;
    case v1::DTYPE_INT64: return 8;
    case v1::DTYPE_UINT8: return 1;
    default: return 0;
  }
}

int64_t NumElements(const v1::Tensor& tensor) {
  int64_t n = 1;
  for (int64_t extent : tensor.shape()) {
    if (extent < 0) {
      throw std::invalid_argument("tensor shape has a negative extent " + std::to_string(extent));
    }
    if (extent != 0 && n > std::numeric_limits<int64_t>::max() / 16 / extent) {
      throw std::invalid_argument("tensor shape is too large");
    }
    n *= extent;
  }
  return n;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {  // inf / nan
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {  // +-0
    bits = sign;
  } else {  // subnormal: renormalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3FFu;
    bits = sign | (exp << 23) | (mant << 13);
  }
  return BitsToFloat(bits);
}

float BFloat16ToFloat(uint16_t bits) { return BitsToFloat(static_cast<uint32_t>(bits) << 16); }

std::vector<float> DecodeTensor(const v1::Tensor& tensor) {
  const int64_t n = CheckFloatTensor(tensor);
  return DecodeRange(tensor, 0, n);
}

std::vector<float> DecodeLastRow(const v1::Tensor& tensor) {
  const int64_t n = CheckFloatTensor(tensor);
  if (tensor.shape_size() == 0) throw std::invalid_argument("tensor has rank 0; it has no rows");
  const int64_t rows = tensor.shape(0);
  if (rows == 0) throw std::invalid_argument("tensor has no rows");
  const int64_t width = n / rows;
  return DecodeRange(tensor, (rows - 1) * width, width);
}

}  // namespace llmstage
