// The decoder layer's small row-wise operations on the CPU, fused so that a decode step of a few rows does not pay
// torch's per-operator overhead several times per layer (rms_norm alone is six operators in torch 2.13):
//
//   rms_norm(x [M, K], w [K], eps)            x / sqrt(mean(x^2) + eps) * w                 (Llama's RMSNorm)
//   add_rms_norm_(x [M, K], d [M, K], w, eps)  x += d in place, then rms_norm(x)             (residual + norm)
//   silu_mul(gu [M, 2I])                       silu(gu[:, :I]) * gu[:, I:]                   (SwiGLU)
//   rope_(x [T, W], heads, D, cos, sin [T, D/2])  each of the first `heads` head_dim-wide slices of a row:
//                                              [x1 cos - x2 sin, x2 cos + x1 sin] in place (rotate_half RoPE)
//
// All float32, contiguous rows. Every row is computed alone, in a fixed order: batch invariant.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>

namespace {

using sluice::hsum;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name,
              " must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(x.size(1) % 8 == 0, name, " must have a multiple of 8 columns");
}

void norm_row(const float* x, const float* w, float eps, int64_t K, float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < K; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(K) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  for (int64_t j = 0; j < K; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vr), _mm256_loadu_ps(w + j)));
  }
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.numel() == x.size(1) && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be [K]");
  auto out = torch::empty_like(x);
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) norm_row(xp + i * K, w.data_ptr<float>(), static_cast<float>(eps), K, op + i * K);
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must be like x");
  TORCH_CHECK(w.numel() == x.size(1) && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be [K]");
  auto out = torch::empty_like(x);
  const int64_t M = x.size(0), K = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = xp + i * K;
      for (int64_t j = 0; j < K; j += 8) {
        _mm256_storeu_ps(row + j, _mm256_add_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(dp + i * K + j)));
      }
      norm_row(row, w.data_ptr<float>(), static_cast<float>(eps), K, op + i * K);
    }
  });
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % 8 == 0, "gate_up must have a multiple of 16 columns");
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = gp + i * 2 * I;
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (int64_t j = 0; j < I; j += 8) {
        const __m256 gate = _mm256_loadu_ps(g + j);
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, sluice::exp256(_mm256_xor_ps(gate, sign))));
        _mm256_storeu_ps(op + i * I + j, _mm256_mul_ps(silu, _mm256_loadu_ps(g + I + j)));
      }
    }
  });
  return out;
}

void rope_(torch::Tensor& x, int64_t heads, int64_t head_dim, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "x must be a [T, W] float32 tensor with contiguous rows");
  const int64_t T = x.size(0), D = head_dim, half = D / 2, row_stride = x.stride(0);
  TORCH_CHECK(half % 8 == 0 && heads * D <= x.size(1), "head_dim must be a multiple of 16 and heads * head_dim <= W");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == half && cos.is_contiguous() &&
              sin.sizes() == cos.sizes() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32, "cos and sin must be contiguous [T, D / 2] float32 tensors");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        float* row = xp + t * row_stride + h * D;
        for (int64_t j = 0; j < half; j += 8) {
          const __m256 c = _mm256_loadu_ps(cp + t * half + j), s = _mm256_loadu_ps(sp + t * half + j);
          const __m256 x1 = _mm256_loadu_ps(row + j), x2 = _mm256_loadu_ps(row + half + j);
          _mm256_storeu_ps(row + j, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
          _mm256_storeu_ps(row + half + j, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
        }
      }
    }
  });
}
