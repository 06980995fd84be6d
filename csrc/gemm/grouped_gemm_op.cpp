// Grouped GEMM: argument checks, the products of each pass, the kernels (contract:
// grouped_gemm.h).
#include "gemm/grouped_gemm.h"

namespace fusedlayers {
namespace {

constexpr int64_t kMaxRows = int64_t(1) << 31;

std::string num(int64_t v) { return std::to_string(v); }

GroupedGemmShape check_operands(const char* op, const TensorRef& x, const TensorRef& weight,
                                const IndexRef& offsets, bool transposed) {
  if (x.sizes.size != 2) arg_error(op, "x must be 2-D (rows, k), got shape " + x.sizes.str());
  if (weight.dtype != x.dtype)
    arg_error(op, std::string("weight must have x's dtype ") + dtype_name(x.dtype) + ", got " +
                      dtype_name(weight.dtype),
              Error::Kind::kType);
  const char* layout = transposed ? "(num_groups, k, n)" : "(num_groups, n, k)";
  if (weight.sizes.size != 3)
    arg_error(op, std::string("weight must be 3-D ") + layout + ", got shape " +
                      weight.sizes.str());
  GroupedGemmShape s;
  s.rows = x.sizes[0];
  s.k = x.sizes[1];
  s.groups = weight.sizes[0];
  s.n = transposed ? weight.sizes[2] : weight.sizes[1];
  const int64_t weight_k = transposed ? weight.sizes[1] : weight.sizes[2];
  if (weight_k != s.k)
    arg_error(op, std::string("weight ") + layout + " must have x's k = " + num(s.k) +
                      ", got shape " + weight.sizes.str());
  if (s.groups < 1) arg_error(op, "weight must have at least one group, got 0");
  if (offsets.type != IndexType::kInt32)
    arg_error(op, "offsets must be int32 (as moe_permute returns them)", Error::Kind::kType);
  if (offsets.sizes.size != 1 || offsets.sizes[0] != s.groups)
    arg_error(op, "offsets must have shape [" + num(s.groups) + "] (one end per group), got " +
                      offsets.sizes.str());
  if (s.rows >= kMaxRows) arg_error(op, "x must have fewer than 2^31 rows, got " + num(s.rows));
  if (s.k >= kMaxRows || s.n >= kMaxRows)
    arg_error(op, "k and n must be below 2^31, got " + num(s.k) + " and " + num(s.n));
  return s;
}

}  // namespace

// The passes' products (GroupedProduct), W_g taken as the (k x n) matrix of y = x @ W_g
// whatever its storage.
GroupedProduct grouped_gemm_fprop(const GroupedGemmForward& a, const GroupedGemmShape& s) {
  GroupedProduct p{a.x.data, a.weight.data, a.y, static_cast<const int32_t*>(a.offsets.data),
                   s.groups, s.rows, s.rows, s.n, s.k};
  p.a_m = s.k, p.a_k = 1;
  if (a.transposed)
    p.b_k = s.n, p.b_n = 1;  // W_g stored (k, n)
  else
    p.b_k = 1, p.b_n = s.k;  // stored (n, k)
  return p;
}

GroupedProduct grouped_gemm_dgrad(const GroupedGemmBackward& a, const GroupedGemmShape& s) {
  GroupedProduct p{a.dy.data, a.weight.data, a.dx, static_cast<const int32_t*>(a.offsets.data),
                   s.groups, s.rows, s.rows, s.k, s.n};
  p.a_m = s.n, p.a_k = 1;
  if (a.transposed)
    p.b_k = 1, p.b_n = s.n;  // W_g^T (n x k) of W_g stored (k, n)
  else
    p.b_k = s.k, p.b_n = 1;
  return p;
}

// dW_g in weight's layout: (k x n) = x_g^T dy_g, or stored (n, k): dy_g^T x_g.
GroupedProduct grouped_gemm_wgrad(const GroupedGemmBackward& a, const GroupedGemmShape& s) {
  const bool kn = a.transposed;
  GroupedProduct p{kn ? a.x.data : a.dy.data, kn ? a.dy.data : a.x.data, a.dweight,
                   static_cast<const int32_t*>(a.offsets.data), s.groups, s.rows,
                   kn ? s.k : s.n, kn ? s.n : s.k, 0};
  p.a_m = 1, p.a_k = p.m;  // A_g = (rows of g x m)^T
  p.b_k = p.n, p.b_n = 1;
  p.ragged_m = false;
  return p;
}

void grouped_gemm_offsets_check(const char* op, const int32_t* offsets, int64_t groups,
                                int64_t rows) {
  int64_t before = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t end = offsets[g];
    if (end < before || end > rows)
      arg_error(op, "offsets must be the groups' row ends, each in [" + num(before) + ", " +
                        num(rows) + "] (at least the one before it, at most x's rows), got "
                        "offsets[" + num(g) + "] = " + num(end));
    before = end;
  }
}

namespace {

void forward_cpu(const GroupedGemmForward& a, const GroupedGemmShape& s, const Exec& exec) {
  grouped_gemm_offsets_check("grouped_gemm", static_cast<const int32_t*>(a.offsets.data),
                             s.groups, s.rows);
  grouped_product_cpu(grouped_gemm_fprop(a, s), a.x.dtype, exec.parallel_for);
}

void backward_cpu(const GroupedGemmBackward& a, const GroupedGemmShape& s, const Exec& exec) {
  grouped_gemm_offsets_check("grouped_gemm_backward",
                             static_cast<const int32_t*>(a.offsets.data), s.groups, s.rows);
  if (a.dx) grouped_product_cpu(grouped_gemm_dgrad(a, s), a.x.dtype, exec.parallel_for);
  if (a.dweight) grouped_product_cpu(grouped_gemm_wgrad(a, s), a.x.dtype, exec.parallel_for);
}

}  // namespace

GroupedGemmShape grouped_gemm_forward_check(const GroupedGemmForward& a) {
  return check_operands("grouped_gemm", a.x, a.weight, a.offsets, a.transposed);
}

GroupedGemmShape grouped_gemm_backward_check(const GroupedGemmBackward& a) {
  const char* op = "grouped_gemm_backward";
  const GroupedGemmShape s = check_operands(op, a.x, a.weight, a.offsets, a.transposed);
  if (a.dy.dtype != a.x.dtype)
    arg_error(op, std::string("dy must have x's dtype ") + dtype_name(a.x.dtype) + ", got " +
                      dtype_name(a.dy.dtype),
              Error::Kind::kType);
  if (a.dy.sizes.size != 2 || a.dy.sizes[0] != s.rows || a.dy.sizes[1] != s.n)
    arg_error(op, "dy must have shape [" + num(s.rows) + ", " + num(s.n) + "] (rows, n), got " +
                      a.dy.sizes.str());
  return s;
}

size_t grouped_gemm_workspace_size(const GroupedGemmShape& s, DType dtype, const Exec& exec) {
  return FUSEDLAYERS_ON_DEVICE(exec, size_t{0}, grouped_gemm_workspace_size_cuda(s, dtype));
}

void grouped_gemm_forward(const GroupedGemmForward& a, const GroupedGemmShape& s,
                          const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, forward_cpu(a, s, exec),
                        grouped_gemm_forward_cuda(a, s, exec.stream));
}

void grouped_gemm_backward(const GroupedGemmBackward& a, const GroupedGemmShape& s,
                           const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, backward_cpu(a, s, exec),
                        grouped_gemm_backward_cuda(a, s, exec.stream));
}

GroupedGemmPath grouped_gemm_cuda_path(DType dtype, const GroupedGemmShape& s, int arch) {
  const bool sm90 = grouped_gemm_sm90_built() && arch == 90 && dtype == DType::kBFloat16 &&
                    s.k % 8 == 0 && s.n % 8 == 0 && s.k > 0 && s.n > 0;
  return sm90 ? GroupedGemmPath::kSm90 : GroupedGemmPath::kTiled;
}

bool grouped_gemm_sm90_built() {
#ifdef FUSEDLAYERS_WITH_CUTLASS_SM90
  return true;
#else
  return false;
#endif
}

}  // namespace fusedlayers
