// The expert weights as the GEMM and GEMV kernels read them: one reader per
// weight format of abi.h, each giving element (k, n) of one expert's [K][N]
// matrix as float32, decoded in place from the format's parts as it is
// loaded (never a dequantized copy).  The formats are defined by
// xla_ffi/formats/<name>.h (parts, packing, groups, scalar reference);
// Apple's compiler cannot include those (no standard library), so this is
// their MSL decoding, and every function here is checked against them, every
// code and every format, bit for bit (tests/metal/test_metal_kernels.py
// through tests/native/metal_tests.cc), and through the kernels against float64.
//
// The pointer table holds the parts' GPU addresses in abi.h's buffer-group
// order: table[(part * 3 + projection) * E + e] (part 0 q, 1 scale, 2 zero;
// dense weights: part 0 only, so [projection][E] as before).  Each reader's
// `load` takes its parts' addresses through nbx_device_ptr with the part's
// extent (the emulation checks it against the pins); `at(k, n)` decodes.
// A reader per kernel variant: the format is a compile-time choice (the
// kernel's name), the group size along K a parameter (GemmParams::group; the
// last group may be partial, k / G its index all the same).

// ---- element encodings (formats/minifloat.h): E2M1, E4M3 ("fn"), E8M0

// E2M1 code (4 bits: sign 3, exponent 2-1 bias 1, mantissa 0): 0, 0.5, 1,
// 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0).
inline float nbx_e2m1(uint code) {
  const uint e = (code >> 1) & 3u, m = code & 1u;
  const uint mag = e == 0u ? (m != 0u ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (m << 22));
  return as_type<float>(mag | ((code & 8u) << 28));
}

// E4M3 byte (sign 7, exponent 6-3 bias 7, mantissa 2-0; exponent 0
// subnormal m * 2^-9; S.1111.111 NaN, no infinity).
inline float nbx_e4m3(uint b) {
  const uint e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
  if (e == 15u && m == 7u) return as_type<float>(0x7FC00000u);
  if (e == 0u) return as_type<float>(sign | as_type<uint>(float(m) * 0.001953125f));
  return as_type<float>(sign | ((e + 120u) << 23) | (m << 20));
}

// E8M0 byte s: 2^(s - 127) (s = 0: 2^-127, a float32 subnormal; 255: NaN).
inline float nbx_e8m0(uint s) {
  return as_type<float>(s == 255u ? 0x7FC00000u : (s == 0u ? 0x00400000u : s << 23));
}

// The 4-bit value of row k, column n of a [K/2][N] array packed two per byte
// along K, the even row in the low nibble (int4, mxfp4, nvfp4).
inline uint nbx_nibble(device const uchar* q, uint k, uint n, uint N) {
  const uint b = q[(ulong)(k / 2u) * N + n];
  return (k & 1u) != 0u ? b >> 4 : b & 15u;
}

// Rows of a per-group part along K: one per started group, ceil(K / group)
// (formats whose last group may be partial: FormatSpec::partial_groups).
inline uint nbx_groups(constant GemmParams& p) { return (p.K + p.group - 1u) / p.group; }

// The GPU address of part `part` of projection `proj` (0 gate, 1 up, 2 down), expert e.
inline ulong nbx_part(device const ulong* table, uint part, uint proj, int e, constant GemmParams& p) {
  return table[(part * 3u + proj) * p.E + (uint)e];
}

// ---- one reader per format (and per element type of the dense weights or float scales)

// dense: W[k, n] (float, half or bfloat).
template <typename WT>
struct nbx_dense {
  device const WT* w;
  uint N;
  static nbx_dense load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_dense r;
    r.w = nbx_device_ptr<const WT>(nbx_part(table, 0u, proj, e, p), (long)p.K * p.N);
    r.N = p.N;
    return r;
  }
  float at(uint k, uint n) const { return float(w[(ulong)k * N + n]); }
};

// int8: q[k, n] * scale[n] (formats/int8.h), one float32 product.
template <typename ST>
struct nbx_int8 {
  device const int8_t* q;
  device const ST* s;
  uint N;
  static nbx_int8 load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_int8 r;
    r.q = nbx_device_ptr<const int8_t>(nbx_part(table, 0u, proj, e, p), (long)p.K * p.N);
    r.s = nbx_device_ptr<const ST>(nbx_part(table, 1u, proj, e, p), (long)p.N);
    r.N = p.N;
    return r;
  }
  float at(uint k, uint n) const { return float(q[(ulong)k * N + n]) * float(s[n]); }
};

// int4: fma(nibble, scale[k/G, n], zero[k/G, n]) (formats/int4.h).
template <typename ST>
struct nbx_int4 {
  device const uchar* q;
  device const ST* s;
  device const ST* z;
  uint N, G;
  static nbx_int4 load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_int4 r;
    r.q = nbx_device_ptr<const uchar>(nbx_part(table, 0u, proj, e, p), (long)(p.K / 2u) * p.N);
    r.s = nbx_device_ptr<const ST>(nbx_part(table, 1u, proj, e, p), (long)nbx_groups(p) * p.N);
    r.z = nbx_device_ptr<const ST>(nbx_part(table, 2u, proj, e, p), (long)nbx_groups(p) * p.N);
    r.N = p.N;
    r.G = p.group;
    return r;
  }
  float at(uint k, uint n) const {
    const ulong g = (ulong)(k / G) * N + n;
    return fma(float(nbx_nibble(q, k, n, N)), float(s[g]), float(z[g]));
  }
};

// fp8: E4M3(q[k, n]) * scale[k/G, n] (formats/fp8.h), one float32 product.
template <typename ST>
struct nbx_fp8 {
  device const uchar* q;
  device const ST* s;
  uint N, G;
  static nbx_fp8 load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_fp8 r;
    r.q = nbx_device_ptr<const uchar>(nbx_part(table, 0u, proj, e, p), (long)p.K * p.N);
    r.s = nbx_device_ptr<const ST>(nbx_part(table, 1u, proj, e, p), (long)nbx_groups(p) * p.N);
    r.N = p.N;
    r.G = p.group;
    return r;
  }
  float at(uint k, uint n) const {
    return nbx_e4m3(q[(ulong)k * N + n]) * float(s[(ulong)(k / G) * N + n]);
  }
};

// The microscaling formats: a code times its block's byte scale, both
// decoded (mxfp4: E2M1 x E8M0, formats/mxfp4.h; mxfp8: E4M3 x E8M0,
// formats/mxfp8.h; nvfp4: E2M1 x E4M3, formats/nvfp4.h): exact products.
struct nbx_mxfp4 {
  device const uchar* q;
  device const uchar* s;
  uint N, G;
  static nbx_mxfp4 load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_mxfp4 r;
    r.q = nbx_device_ptr<const uchar>(nbx_part(table, 0u, proj, e, p), (long)(p.K / 2u) * p.N);
    r.s = nbx_device_ptr<const uchar>(nbx_part(table, 1u, proj, e, p), (long)nbx_groups(p) * p.N);
    r.N = p.N;
    r.G = p.group;
    return r;
  }
  float at(uint k, uint n) const {
    return nbx_e2m1(nbx_nibble(q, k, n, N)) * nbx_e8m0(s[(ulong)(k / G) * N + n]);
  }
};

struct nbx_mxfp8 {
  device const uchar* q;
  device const uchar* s;
  uint N, G;
  static nbx_mxfp8 load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_mxfp8 r;
    r.q = nbx_device_ptr<const uchar>(nbx_part(table, 0u, proj, e, p), (long)p.K * p.N);
    r.s = nbx_device_ptr<const uchar>(nbx_part(table, 1u, proj, e, p), (long)nbx_groups(p) * p.N);
    r.N = p.N;
    r.G = p.group;
    return r;
  }
  float at(uint k, uint n) const {
    return nbx_e4m3(q[(ulong)k * N + n]) * nbx_e8m0(s[(ulong)(k / G) * N + n]);
  }
};

struct nbx_nvfp4 {
  device const uchar* q;
  device const uchar* s;
  uint N, G;
  static nbx_nvfp4 load(device const ulong* table, uint proj, int e, constant GemmParams& p) {
    nbx_nvfp4 r;
    r.q = nbx_device_ptr<const uchar>(nbx_part(table, 0u, proj, e, p), (long)(p.K / 2u) * p.N);
    r.s = nbx_device_ptr<const uchar>(nbx_part(table, 1u, proj, e, p), (long)nbx_groups(p) * p.N);
    r.N = p.N;
    r.G = p.group;
    return r;
  }
  float at(uint k, uint n) const {
    return nbx_e2m1(nbx_nibble(q, k, n, N)) * nbx_e4m3(s[(ulong)(k / G) * N + n]);
  }
};
