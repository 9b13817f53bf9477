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

// grid (M), block (256): row blockIdx.x of x [M, K] fp32.
template <class T>
__device__ __forceinline__ void rms_norm_body(unsigned short* __restrict__ out, const float* __restrict__ x,
                                              const float* __restrict__ w, int K, float eps) {
  const long long row = blockIdx.x;
  const float* xr = x + row * K;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < K; j += blockDim.x) ss = fmaf(xr[j], xr[j], ss);
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(K) + eps);
  for (int j = threadIdx.x; j < K; j += blockDim.x) out[row * K + j] = T::pack(xr[j] * r * w[j]);
}

// grid (M), block (256): x [M, K] fp32 += delta [M, K] (16-bit), then out = rms_norm(x).
template <class T>
__device__ __forceinline__ void add_rms_norm_body(unsigned short* __restrict__ out, float* __restrict__ x,
                                                  const unsigned short* __restrict__ delta,
                                                  const float* __restrict__ w, int K, float eps) {
  const long long row = blockIdx.x;
  float* xr = x + row * K;
  const unsigned short* dr = delta + row * K;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < K; j += blockDim.x) {  // each thread reads back only what it wrote
    const float v = xr[j] + T::load(dr[j]);
    xr[j] = v;
    ss = fmaf(v, v, ss);
  }
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(K) + eps);
  for (int j = threadIdx.x; j < K; j += blockDim.x) out[row * K + j] = T::pack(xr[j] * r * w[j]);
}

// grid (num_tokens), block (128): qkv [num_tokens, row_stride]; cos / sin [num_tokens, head_dim / 2].
template <class T>
__device__ __forceinline__ void rope_body(unsigned short* __restrict__ qkv, long long row_stride, int num_heads,
                                          int head_dim, const unsigned short* __restrict__ cos,
                                          const unsigned short* __restrict__ sin) {
  const long long token = blockIdx.x;
  const int half = head_dim / 2;
  unsigned short* row = qkv + token * row_stride;
  for (int idx = threadIdx.x; idx < num_heads * half; idx += blockDim.x) {
    const int head = idx / half;
    const int i = idx % half;
    unsigned short* x = row + head * head_dim;
    const float x1 = T::load(x[i]);
    const float x2 = T::load(x[i + half]);
    const float c = T::load(cos[token * half + i]);
    const float s = T::load(sin[token * half + i]);
    x[i] = T::pack(x1 * c - x2 * s);
    x[i + half] = T::pack(x2 * c + x1 * s);
  }
}

// grid-stride over M * I elements: gu [M, 2I], out [M, I].
template <class T>
__device__ __forceinline__ void silu_mul_body(unsigned short* __restrict__ out,
                                              const unsigned short* __restrict__ gu, int inter, long long total) {
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long row = idx / inter;
    const int col = static_cast<int>(idx % inter);
    const float g = T::load(gu[row * 2 * inter + col]);
    const float u = T::load(gu[row * 2 * inter + inter + col]);
    out[idx] = T::pack(g / (1.0f + __expf(-g)) * u);
  }
}

}  // namespace sluice_ops

// grid (num_tokens), block (128): copy token t's K and V ([num_kv_heads, head_dim] each, rows of strided views)
// to slot slot_mapping[t] of one layer's pools [num_blocks, num_kv_heads, block_size, head_dim] (strides
// (kv_block_stride, kv_head_stride, head_dim, 1)). 16-bit elements are copied as they are, whatever the dtype.
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
  const long long offset = slot % block_size;
  for (int idx = threadIdx.x; idx < num_kv_heads * head_dim; idx += blockDim.x) {
    const int head = idx / head_dim;
    const int d = idx % head_dim;
    const long long dst = block * kv_block_stride + head * kv_head_stride + offset * head_dim + d;
    k_cache[dst] = k[token * k_row_stride + head * k_head_stride + d];
    v_cache[dst] = v[token * v_row_stride + head * v_head_stride + d];
  }
}

#define SLUICE_LAYER_OPS(NAME, TRAITS)                                                                          \
  extern "C" __global__ void rms_norm_##NAME(unsigned short* __restrict__ out, const float* __restrict__ x,     \
                                             const float* __restrict__ w, int K, float eps) {                  \
    sluice_ops::rms_norm_body<sluice_ops::TRAITS>(out, x, w, K, eps);                                           \
  }                                                                                                             \
  extern "C" __global__ void add_rms_norm_##NAME(unsigned short* __restrict__ out, float* __restrict__ x,       \
                                                 const unsigned short* __restrict__ delta,                      \
                                                 const float* __restrict__ w, int K, float eps) {              \
    sluice_ops::add_rms_norm_body<sluice_ops::TRAITS>(out, x, delta, w, K, eps);                                \
  }                                                                                                             \
  extern "C" __global__ void rope_##NAME(unsigned short* __restrict__ qkv, long long row_stride, int num_heads, \
                                         int head_dim, const unsigned short* __restrict__ cos,                  \
                                         const unsigned short* __restrict__ sin) {                              \
    sluice_ops::rope_body<sluice_ops::TRAITS>(qkv, row_stride, num_heads, head_dim, cos, sin);                  \
  }                                                                                                             \
  extern "C" __global__ void silu_mul_##NAME(unsigned short* __restrict__ out,                                   \
                                             const unsigned short* __restrict__ gu, int inter, long long total) { \
    sluice_ops::silu_mul_body<sluice_ops::TRAITS>(out, gu, inter, total);                                       \
  }

SLUICE_LAYER_OPS(bf16, Bf16)
SLUICE_LAYER_OPS(f16, F16)
