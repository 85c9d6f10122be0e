// The C++ type of each attribute KIND of abi.h's attribute lists, and the
// expansions the handlers' bindings use:
//   Ffi::Bind()...NBX_ATTRS_CPU_FORWARD(NBX_BIND_ATTR)       .Attr<type>("name") each
//   Handler(..., Result<...> y NBX_ATTRS_CPU_FORWARD(NBX_ATTR_PARAM))   , type name each
#pragma once

#include <cstdint>

#include "abi.h"
#include "xla/ffi/api/ffi.h"

// abi.h's enums travel as typed int32 attributes.
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(nbx::abi::Activation);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(nbx::abi::WeightFormat);

#define NBX_ATTR_TYPE_ACT ::nbx::abi::Activation
#define NBX_ATTR_TYPE_FMT ::nbx::abi::WeightFormat
#define NBX_ATTR_TYPE_F32 float
#define NBX_ATTR_TYPE_I64 int64_t
#define NBX_ATTR_TYPE_BOOL bool
#define NBX_ATTR_TYPE_I64S ::xla::ffi::Span<const int64_t>
#define NBX_ATTR_TYPE_U8S ::xla::ffi::Span<const uint8_t>

#define NBX_BIND_ATTR(kind, name) .Attr<NBX_ATTR_TYPE_##kind>(#name)
#define NBX_ATTR_PARAM(kind, name) , NBX_ATTR_TYPE_##kind name
