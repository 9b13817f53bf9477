// The decoder layer's row-wise operations on CUDA, one kernel each, for bf16 / fp16 activations (the GPU twins of
// worker/cpu_kernels/elementwise.cpp), plus the K/V write into the paged pool:
//
//   rms_norm       out[M, K]  = x / sqrt(mean(x^2) + eps) * w            x fp32 (residual stream), w fp32
//   add_rms_norm   x += delta (in place, fp32), then out = rms_norm(x)   delta in the activations' dtype
//   rope           each of the first `num_heads` head_dim-wide slices of a qkv row, halves x1 | x2:
//                  [x1 cos - x2 sin, x2 cos + x1 sin] in place           (rotate_half RoPE, Llama / HF)
//   silu_mul       out[M, I] = silu(gu[:, :I]) * gu[:, I:]               (SwiGLU)
//   write_kv       K and V rows of a step's tokens into their pool slots (slot = block_id * block_size + offset;
//                  a negative slot is skipped)
//
// Why: a decode step of an 8B model at a few rows runs in CUDA graphs, where every kernel still costs a few
// microseconds whatever its size; torch spends 7 kernels on RoPE, 3 on a residual add + RMSNorm + cast, 2 on SwiGLU
// and 8 on computing pool rows and writing K/V (bench/decode_profile.py, H200: about 35 kernels per layer, 2.5 ms of
// a 6.7 ms one-sequence step outside the matmuls and attention). These are 5 per layer.
//
// Math in fp32; 16-bit values are loaded, converted, and rounded once to nearest even on store (torch rounds after
// each operator, so results agree to a unit or two in the last bf16 place). Every row is computed by one CTA in a
// fixed order: batch invariant. Self-contained (no #include): builds the same with nvcc and NVRTC (CuPy).
// Entry points: <op>_bf16 and <op>_f16; launch shapes are in worker/cuda_kernels/__init__.py.

namespace sluice_ops {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxWarps = 32;

__device__ __forceinline__ int const_min(int a, int b) { return a < b ? a : b; }

struct Bf16 {
  static __device__ __forceinline__ float load(unsigned short x) { return __uint_as_float(static_cast<unsigned>(x) << 16); }
  static __device__ __forceinline__ unsigned short pack(float f) {  // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
  }
};

struct F16 {
  static __device__ __forceinline__ float load(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  static __device__ __forceinline__ unsigned short pack(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

// Sum of v over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kMaxWarps];
  for (int mask = kWarpSize / 2; mask >= 1; mask /= 2) v += __shfl_xor_sync(kFullMask, v, mask);
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) partial[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += partial[w];
  return total;
}

// Rows of K fp32 / 16-bit values are read in vectors of 4 (16 / 8 bytes): K % 4 == 0, rows 16-byte aligned. Thread t
// of a CTA holds the vectors t, t + blockDim.x, ... (at most kMaxVecsPerThread) in registers between the two passes.
constexpr int kMaxVecsPerThread = 4;

__device__ __forceinline__ float4 load_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }

template <class T>
__device__ __forceinline__ float4 load_h4(const unsigned short* p) {  // 4 16-bit values (8 bytes) as fp32
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  return make_float4(T::load(static_cast<unsigned short>(raw.x & 0xffffu)), T::load(static_cast<unsigned short>(raw.x >> 16)),
                     T::load(static_cast<unsigned short>(raw.y & 0xffffu)), T::load(static_cast<unsigned short>(raw.y >> 16)));
}

template <class T>
__device__ __forceinline__ void store_h4(unsigned short* p, float a, float b, float c, float d) {
  uint2 raw;
  raw.x = static_cast<unsigned>(T::pack(a)) | (static_cast<unsigned>(T::pack(b)) << 16);
  raw.y = static_cast<unsigned>(T::pack(c)) | (static_cast<unsigned>(T::pack(d)) << 16);
  *reinterpret_cast<uint2*>(p) = raw;
}

// grid (M), block (threads: K / 4 <= kMaxVecsPerThread * threads): row blockIdx.x of x [M, K] fp32; with kAdd,
// x += delta [M, K] (16-bit) in place first.
template <class T, bool kAdd>
__device__ __forceinline__ void rms_norm_body(unsigned short* __restrict__ out, float* __restrict__ x,
                                              const unsigned short* __restrict__ delta, const float* __restrict__ w,
                                              int K, float eps) {
  const long long row = blockIdx.x;
  float* xr = x + row * K;
  const int num_vecs = K / 4;
  float4 v[kMaxVecsPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxVecsPerThread; ++i) {
    const int vec = threadIdx.x + i * blockDim.x;
    v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (vec < num_vecs) {
      v[i] = load_f4(xr + 4 * vec);
      if (kAdd) {
        const float4 d = load_h4<T>(delta + row * K + 4 * vec);
        v[i].x += d.x;
        v[i].y += d.y;
        v[i].z += d.z;
        v[i].w += d.w;
        *reinterpret_cast<float4*>(xr + 4 * vec) = v[i];
      }
      ss = fmaf(v[i].x, v[i].x, ss);
      ss = fmaf(v[i].y, v[i].y, ss);
      ss = fmaf(v[i].z, v[i].z, ss);
      ss = fmaf(v[i].w, v[i].w, ss);
    }
  }
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(K) + eps);
#pragma unroll
  for (int i = 0; i < kMaxVecsPerThread; ++i) {
    const int vec = threadIdx.x + i * blockDim.x;
    if (vec < num_vecs) {
      const float4 wv = load_f4(w + 4 * vec);
      store_h4<T>(out + row * K + 4 * vec, v[i].x * r * wv.x, v[i].y * r * wv.y, v[i].z * r * wv.z, v[i].w * r * wv.w);
    }
  }
}

// grid (num_tokens, num_heads), block (head_dim / 2): thread i rotates the pair (i, i + head_dim / 2) of one head
// of one token of qkv [num_tokens, row_stride]; cos / sin [num_tokens, head_dim / 2].
template <class T>
__device__ __forceinline__ void rope_body(unsigned short* __restrict__ qkv, long long row_stride, int head_dim,
                                          const unsigned short* __restrict__ cos,
                                          const unsigned short* __restrict__ sin) {
  const long long token = blockIdx.x;
  const int half = head_dim / 2;
  const int i = threadIdx.x;
  unsigned short* x = qkv + token * row_stride + static_cast<long long>(blockIdx.y) * head_dim;
  const float x1 = T::load(x[i]);
  const float x2 = T::load(x[i + half]);
  const float c = T::load(cos[token * half + i]);
  const float s = T::load(sin[token * half + i]);
  x[i] = T::pack(x1 * c - x2 * s);
  x[i + half] = T::pack(x2 * c + x1 * s);
}

// grid (ceil(I / (8 * blockDim.x)), M): thread t of row blockIdx.y takes columns [8c, 8c + 8), c = global index;
// gu [M, 2I], out [M, I]. 16-byte vectors when I % 8 == 0 (then every row is 16-byte aligned), else element-wise.
template <class T>
__device__ __forceinline__ void silu_mul_body(unsigned short* __restrict__ out,
                                              const unsigned short* __restrict__ gu, int inter) {
  const long long row = blockIdx.y;
  const int col = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (col >= inter) return;
  const unsigned short* gate = gu + row * 2 * inter + col;
  const unsigned short* up = gate + inter;
  unsigned short* dst = out + row * inter + col;
  if ((inter & 7) == 0) {
    const uint4 g4 = *reinterpret_cast<const uint4*>(gate);
    const uint4 u4 = *reinterpret_cast<const uint4*>(up);
    const unsigned g_words[4] = {g4.x, g4.y, g4.z, g4.w};
    const unsigned u_words[4] = {u4.x, u4.y, u4.z, u4.w};
    unsigned o_words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      unsigned packed = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float g = T::load(static_cast<unsigned short>((g_words[k] >> (16 * h)) & 0xffffu));
        const float u = T::load(static_cast<unsigned short>((u_words[k] >> (16 * h)) & 0xffffu));
        packed |= static_cast<unsigned>(T::pack(g / (1.0f + __expf(-g)) * u)) << (16 * h);
      }
      o_words[k] = packed;
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(o_words[0], o_words[1], o_words[2], o_words[3]);
  } else {
    const int count = const_min(8, inter - col);
    for (int k = 0; k < count; ++k) {
      const float g = T::load(gate[k]);
      const float u = T::load(up[k]);
      dst[k] = T::pack(g / (1.0f + __expf(-g)) * u);
    }
  }
}

}  // namespace sluice_ops

// grid (num_tokens), block (threads): copy token t's K and V ([num_kv_heads, head_dim] each, rows of strided views)
// to slot slot_mapping[t] of one layer's pools [num_blocks, num_kv_heads, block_size, head_dim] (strides
// (kv_block_stride, kv_head_stride, head_dim, 1)), 8 elements (16 bytes) per thread and loop: head_dim % 8 == 0, every
// pointer 16-byte aligned and every stride a multiple of 8 (the launcher checks). 16-bit elements are copied as they
// are, whatever the dtype; a negative slot is skipped.
extern "C" __global__ void write_kv_16(unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache,
                                       const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
                                       long long k_row_stride, long long k_head_stride, long long v_row_stride,
                                       long long v_head_stride, const long long* __restrict__ slot_mapping,
                                       int num_kv_heads, int block_size, int head_dim, long long kv_block_stride,
                                       long long kv_head_stride) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long block = slot / block_size;
  const long long offset = slot - block * block_size;
  const int vecs_per_head = head_dim / 8;
  for (int idx = threadIdx.x; idx < num_kv_heads * vecs_per_head; idx += blockDim.x) {
    const int head = idx / vecs_per_head;
    const int d = 8 * (idx - head * vecs_per_head);
    const long long dst = block * kv_block_stride + head * kv_head_stride + offset * head_dim + d;
    *reinterpret_cast<uint4*>(k_cache + dst) =
        *reinterpret_cast<const uint4*>(k + token * k_row_stride + head * k_head_stride + d);
    *reinterpret_cast<uint4*>(v_cache + dst) =
        *reinterpret_cast<const uint4*>(v + token * v_row_stride + head * v_head_stride + d);
  }
}

#define SLUICE_LAYER_OPS(NAME, TRAITS)                                                                          \
  extern "C" __global__ void rms_norm_##NAME(unsigned short* __restrict__ out, float* __restrict__ x,           \
                                             const float* __restrict__ w, int K, float eps) {                  \
    sluice_ops::rms_norm_body<sluice_ops::TRAITS, false>(out, x, nullptr, w, K, eps);                           \
  }                                                                                                             \
  extern "C" __global__ void add_rms_norm_##NAME(unsigned short* __restrict__ out, float* __restrict__ x,       \
                                                 const unsigned short* __restrict__ delta,                      \
                                                 const float* __restrict__ w, int K, float eps) {              \
    sluice_ops::rms_norm_body<sluice_ops::TRAITS, true>(out, x, delta, w, K, eps);                              \
  }                                                                                                             \
  extern "C" __global__ void rope_##NAME(unsigned short* __restrict__ qkv, long long row_stride, int head_dim,  \
                                         const unsigned short* __restrict__ cos,                                \
                                         const unsigned short* __restrict__ sin) {                              \
    sluice_ops::rope_body<sluice_ops::TRAITS>(qkv, row_stride, head_dim, cos, sin);                             \
  }                                                                                                             \
  extern "C" __global__ void silu_mul_##NAME(unsigned short* __restrict__ out,                                   \
                                             const unsigned short* __restrict__ gu, int inter) {                \
    sluice_ops::silu_mul_body<sluice_ops::TRAITS>(out, gu, inter);                                              \
  }

SLUICE_LAYER_OPS(bf16, Bf16)
SLUICE_LAYER_OPS(f16, F16)
