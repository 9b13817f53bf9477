// Weight-only quantized matmuls for the CPU worker's decode rows: y[M, N] = x[M, K] @ W[N, K]^T, with W stored in
// groups of 32 input features (GGUF's block) and x quantized on the fly to int8 per row and group (llama.cpp's
// Q8 activations, ggml-cpu's ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0 on AVX2).
//
//   q4: codes  uint8 [N, K / 2]   byte 16 g + j of a row = code 32 g + j (low nibble) | code 32 g + 16 + j (high)
//       scale, zero float32 [N, K / 32]      w = (code - 8) * scale + zero     (Q4_0: zero = 0; Q4_1: zero = m + 8 d)
//   q8: codes  int8  [N, K]
//       scale float32 [N, K / 32]            w = code * scale                   (Q8_0)
//   x:  float32 [M, K], K a multiple of 32; each row's group g is quantized to xq = round(x / xd) with
//       xd = max|x| / 127 (round half to even), so sum_k w_k x_k is computed as
//         q4: xd * (scale * sum(code * xq) + (zero - 8 * scale) * sum(xq))
//         q8: xd * scale * sum(code * xq)
//       with the integer sums exact (AVX2 maddubs / madd) and the float sums in a fixed order.
//
// Batch invariance: every output y[i, n] is computed from row i and weight row n alone, by the same instructions in
// the same order whatever M is, whichever rows share the call, however many threads run (threads split N only).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using sluice::hsum;

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 4;    // rows of x whose dot products share one unpacked weight group
constexpr int64_t kGrainN = 16;     // output channels per parallel task at least
constexpr int64_t kTileN = 64;      // output channels whose weights stay in cache while every row block passes

// x [M, K] float32 -> xq [M, K] int8, xd [M, G] float32, xsum [M, G] int32 (sum of a group's xq)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, int32_t* xsum) {
  const int64_t G = K / kGroup;
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = x + i * K + g * kGroup;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float max_abs = _mm_cvtss_f32(m);
      const float d = max_abs / 127.0f;
      const float inv = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
      const __m256 mul = _mm256_set1_ps(inv);
      __m256i q32[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q32[j] = _mm256_cvtps_epi32(r);
      }
      // pack 4 x 8 int32 -> 32 int8 in order (packs work per 128-bit lane: fix the order with a permute)
      const __m256i p01 = _mm256_packs_epi32(q32[0], q32[1]);
      const __m256i p23 = _mm256_packs_epi32(q32[2], q32[3]);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * K + g * kGroup), p);
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]), _mm256_add_epi32(q32[2], q32[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      xd[i * G + g] = d;
      xsum[i * G + g] = _mm_cvtsi128_si32(s4);
    }
  }
}

// 32 codes of a q4 group as bytes 0..15, in the order of the input features
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // |15 * 127 * 2| and |127 * 128 * 2| fit int16
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(K % kGroup == 0, "K = ", K, " is not a multiple of ", kGroup);
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous(), "codes and scale must be contiguous");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.dim() == 2 && scale.size(1) == K / kGroup,
              "scale must be [N, K / 32] float32");
}

struct QuantizedRows {
  std::vector<int8_t> xq;   // [M, K]
  std::vector<float> xd;    // [M, G] the groups' scales
  std::vector<float> xd_sum;  // [M, G] xd * sum of the group's xq (exact integer sum, one rounding)
};

QuantizedRows quantize(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  std::vector<int32_t> xsum(M * G);
  quantize_rows(x.data_ptr<float>(), M, K, q.xq.data(), q.xd.data(), xsum.data());
  for (int64_t j = 0; j < M * G; ++j) q.xd_sum[j] = q.xd[j] * static_cast<float>(xsum[j]);
  return q;
}

// y[r * N] for rows r < R of x (a row block) and one output channel: the weight group is unpacked once for the R
// rows. Each output's arithmetic is the same whatever R is (one accumulator, groups in order).
template <int R>
inline void q4_dot_rows(const uint8_t* wn, const float* scale, const float* zero, int64_t G, int64_t K,
                        const int8_t* xq, const float* xd, const float* xd_sum, float* y, int64_t N) {
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256i wq = unpack_q4(wn + g * 16);
    const float s = scale[g];
    const float m = std::fma(-8.0f, s, zero[g]);  // w = code * s + m
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kGroup));
      acc[r] = _mm256_fmadd_ps(dot_u8_s8(wq, xv), _mm256_set1_ps(xd[r * G + g] * s), acc[r]);
      offset[r] = std::fma(m, xd_sum[r * G + g], offset[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]) + offset[r];
}

template <int R>
inline void q8_dot_rows(const int8_t* wn, const float* scale, int64_t G, int64_t K, const int8_t* xq,
                        const float* xd, float* y, int64_t N) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + g * kGroup));
    const __m256i w_abs = _mm256_sign_epi8(wq, wq);  // -128 stays 0x80, read as 128 by maddubs: still exact
    const float s = scale[g];
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kGroup));
      acc[r] = _mm256_fmadd_ps(dot_u8_s8(w_abs, _mm256_sign_epi8(xv, wq)), _mm256_set1_ps(xd[r * G + g] * s), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]);
}

// Calls kernel.template run<R>(i0, n) over every block of R <= kRowBlock rows and one output channel of [M, N], N split among threads, the weights of kTileN channels reused by every row block while they are in cache.
template <typename Kernel>
void for_each_block(int64_t M, int64_t N, const Kernel& kernel) {
  at::parallel_for(0, N, kGrainN, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kTileN) {
      const int64_t n1 = std::min(end, n0 + kTileN);
      for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - i0);
        for (int64_t n = n0; n < n1; ++n) {
          switch (rows) {
            case 4: kernel.template run<4>(i0, n); break;
            case 3: kernel.template run<3>(i0, n); break;
            case 2: kernel.template run<2>(i0, n); break;
            default: kernel.template run<1>(i0, n); break;
          }
        }
      }
    }
  });
}

struct Q4Kernel {
  const uint8_t* w;
  const float* scale;
  const float* zero;
  const QuantizedRows& q;
  float* y;
  int64_t K, G, N;
  template <int R>
  void run(int64_t i0, int64_t n) const {
    q4_dot_rows<R>(w + n * (K / 2), scale + n * G, zero + n * G, G, K, q.xq.data() + i0 * K,
                   q.xd.data() + i0 * G, q.xd_sum.data() + i0 * G, y + i0 * N + n, N);
  }
};

struct Q8Kernel {
  const int8_t* w;
  const float* scale;
  const QuantizedRows& q;
  float* y;
  int64_t K, G, N;
  template <int R>
  void run(int64_t i0, int64_t n) const {
    q8_dot_rows<R>(w + n * K, scale + n * G, G, K, q.xq.data() + i0 * K, q.xd.data() + i0 * G, y + i0 * N + n, N);
  }
};

}  // namespace

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                        const torch::Tensor& zero) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / kGroup;
  check_inputs(x, codes, scale, K);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.size(1) == K / 2, "codes must be [N, K / 2] uint8");
  TORCH_CHECK(zero.sizes() == scale.sizes() && zero.scalar_type() == torch::kFloat32 && zero.is_contiguous(),
              "zero must be like scale");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const QuantizedRows q = quantize(x);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const float* ws = scale.data_ptr<float>();
  const float* wz = zero.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for_each_block(M, N, Q4Kernel{w, ws, wz, q, y, K, G, N});
  return out;
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / kGroup;
  check_inputs(x, codes, scale, K);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.size(1) == K, "codes must be [N, K] int8");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const QuantizedRows q = quantize(x);
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* ws = scale.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for_each_block(M, N, Q8Kernel{w, ws, q, y, K, G, N});
  return out;
}
