// Python bindings of Sluice's CPU kernels (see worker/cpu_kernels/__init__.py).

#include <torch/extension.h>

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                        const torch::Tensor& zero);
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     double scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void rope_(torch::Tensor& x, int64_t heads, int64_t head_dim, const torch::Tensor& cos, const torch::Tensor& sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x [M, K] float32 @ q4 groups of 32 [N, K]^T -> [M, N] float32");
  m.def("q8_linear", &q8_linear, "x [M, K] float32 @ q8 groups of 32 [N, K]^T -> [M, N] float32");
  m.def("paged_decode_attention", &paged_decode_attention,
        "q [S, H, D] over the paged pools [B, KVH, BS, D] -> [S, H, D] float32");
  m.def("rms_norm", &rms_norm, "x [M, K] / rms * w -> [M, K] float32");
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place; return rms_norm(x, w)");
  m.def("silu_mul", &silu_mul, "gate_up [M, 2I] -> silu(gate) * up [M, I]");
  m.def("rope_", &rope_, "rotate the first heads head_dim-wide slices of each row of x [T, W] in place by cos, sin [T, D / 2]");
}
