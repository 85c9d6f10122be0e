// formats/format.h: reading one element of a part as float32.
#include "formats/format.h"

#include <limits>

#include "dtypes.h"

namespace nbx::formats {

float PartValue(const PartsView& v, int part, int64_t i) {
  const void* p = v.part[part];
  switch (v.dtype[part]) {
    case kF32: return static_cast<const float*>(p)[i];
    case kBF16: return ToFloat(static_cast<const bf16*>(p)[i]);
    case kF16: return ToFloat(static_cast<const f16*>(p)[i]);
    case kS8: return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    case kU8: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
  }
  return std::numeric_limits<float>::quiet_NaN();  // not a DTypeBit: loud, never a value
}

}  // namespace nbx::formats
