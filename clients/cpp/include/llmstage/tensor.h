// Decoding llmstage.v1.Tensor values into float32.
#pragma once

#include <cstdint>
#include <vector>

#include "llmstage/v1/tensor.pb.h"

namespace llmstage {

// Number of elements prod(shape) of a tensor; throws std::invalid_argument on a negative extent
// or an overflowing product.
int64_t NumElements(const v1::Tensor& tensor);

// Bytes per element of a dtype (0 for DTYPE_UNSPECIFIED or an unknown value).
int64_t ItemSize(v1::DType dtype);

// Every element of a FLOAT32, FLOAT16 or BFLOAT16 tensor as float, row-major. Throws
// std::invalid_argument for another dtype or when data does not hold prod(shape) elements.
std::vector<float> DecodeTensor(const v1::Tensor& tensor);

// The last row of a tensor of rank >= 1 (shape [n, ...]: the elements of index n-1 along the
// outermost dimension), as float. Throws std::invalid_argument like DecodeTensor, and when the
// tensor has rank 0 or no rows.
std::vector<float> DecodeLastRow(const v1::Tensor& tensor);

// IEEE binary16 and bfloat16 bit patterns to float.
float HalfToFloat(uint16_t bits);
float BFloat16ToFloat(uint16_t bits);

}  // namespace llmstage
