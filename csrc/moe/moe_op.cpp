// Mixture-of-experts routing: argument checks, then the kernels (contract: moe.h).
#include "moe/moe.h"

namespace fusedlayers {
namespace {

constexpr int64_t kMaxPairs = int64_t(1) << 31;  // rows are int32

std::string num(int64_t v) { return std::to_string(v); }

void check_index_2d(const char* op, const IndexRef& idx) {
  if (idx.sizes.size != 2)
    arg_error(op, "top_k_index must be 2-D (tokens, top_k), got shape " + idx.sizes.str());
}

// `t` (named arg) is a float tensor of `dtype` and shape (rows, cols).
void check_matrix(const char* op, const char* arg, const TensorRef& t, DType dtype,
                  const char* dtype_of, int64_t rows, int64_t cols) {
  if (t.dtype != dtype)
    arg_error(op, std::string(arg) + " must have " + dtype_of + "'s dtype " + dtype_name(dtype) +
                      ", got " + dtype_name(t.dtype),
              Error::Kind::kType);
  if (t.sizes.size != 2 || t.sizes[0] != rows || t.sizes[1] != cols)
    arg_error(op, std::string(arg) + " must have shape [" + num(rows) + ", " + num(cols) +
                      "], got " + t.sizes.str());
}

void check_weights(const char* op, const TensorRef& w, DType dtype, const MoeShape& s) {
  if (!w.defined) return;
  if (w.dtype != dtype && w.dtype != DType::kFloat32)
    arg_error(op, std::string("top_k_weights must be float32 or ") + dtype_name(dtype) + ", got " +
                      dtype_name(w.dtype),
              Error::Kind::kType);
  if (w.sizes.size != 2 || w.sizes[0] != s.tokens || w.sizes[1] != s.top_k)
    arg_error(op, "top_k_weights must have top_k_index's shape [" + num(s.tokens) + ", " +
                      num(s.top_k) + "], got " + w.sizes.str());
}

void check_row_index(const char* op, const IndexRef& r, const MoeShape& s) {
  if (r.type != IndexType::kInt32)
    arg_error(op, "row_index must be int32 (as moe_permute returns it)", Error::Kind::kType);
  if (r.sizes.size != 1 || r.sizes[0] != s.pairs())
    arg_error(op, "row_index must have shape [" + num(s.pairs()) + "] (tokens * top_k), got " +
                      r.sizes.str());
}

}  // namespace

MoeShape moe_route_check(const char* op, const IndexRef& top_k_index, int64_t num_experts) {
  check_index_2d(op, top_k_index);
  if (num_experts < 1 || num_experts > kMaxExperts)
    arg_error(op, "num_experts must be in [1, " + num(kMaxExperts) + "], got " + num(num_experts));
  MoeShape s;
  s.tokens = top_k_index.sizes[0];
  s.top_k = top_k_index.sizes[1];
  s.num_experts = num_experts;
  if (s.top_k < 1) arg_error(op, "top_k_index must have at least one column (top_k), got 0");
  if (s.pairs() >= kMaxPairs)
    arg_error(op, "tokens * top_k must be below 2^31, got " + num(s.pairs()));
  return s;
}

MoeShape moe_scatter_check(const char* op, const MoeScatter& a) {
  MoeShape s = moe_route_check(op, a.top_k_index, a.num_experts);
  // the permute's x, or the unpermute backward's dout
  const char* in_name = std::string(op).rfind("moe_unpermute", 0) == 0 ? "dout" : "x";
  if (a.in.sizes.size != 2)
    arg_error(op, std::string(in_name) + " must be 2-D (tokens, hidden), got shape " +
                      a.in.sizes.str());
  s.hidden = a.in.sizes[1];
  if (a.in.sizes[0] != s.tokens)
    arg_error(op, std::string(in_name) + " must have top_k_index's " + num(s.tokens) +
                      " tokens, got shape " + a.in.sizes.str());
  check_row_index(op, a.row_index, s);
  check_weights(op, a.weights, a.in.dtype, s);
  if (a.ys.defined) {
    if (!a.weights.defined) arg_error(op, "ys needs top_k_weights (dweights is their gradient)");
    check_matrix(op, "ys", a.ys, a.in.dtype, in_name, s.pairs(), s.hidden);
  }
  return s;
}

MoeShape moe_gather_check(const char* op, const MoeGather& a) {
  MoeShape s = moe_route_check(op, a.top_k_index, a.num_experts);
  // the unpermute's ys, or the permute backward's dxs
  const char* in_name = std::string(op).rfind("moe_unpermute", 0) == 0 ? "ys" : "dxs";
  if (a.in.sizes.size != 2)
    arg_error(op, std::string(in_name) + " must be 2-D (tokens * top_k, hidden), got shape " +
                      a.in.sizes.str());
  s.hidden = a.in.sizes[1];
  if (a.in.sizes[0] != s.pairs())
    arg_error(op, std::string(in_name) + " must have tokens * top_k = " + num(s.pairs()) +
                      " rows, got shape " + a.in.sizes.str());
  check_row_index(op, a.row_index, s);
  check_weights(op, a.weights, a.in.dtype, s);
  return s;
}

int64_t moe_index_bytes(const IndexRef& index) {
  return index.sizes.numel() * (index.type == IndexType::kInt32 ? 4 : 8);
}

size_t moe_route_workspace_size(const MoeShape& s, const Exec& exec) {
  return FUSEDLAYERS_ON_DEVICE(exec, size_t(0), moe_route_workspace_size_cuda(s));
}

void moe_route(const MoeRoute& a, const MoeShape& s, const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, moe_route_cpu(a, s), moe_route_cuda(a, s, exec.stream));
}

void moe_scatter(const MoeScatter& a, const MoeShape& s, const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, moe_scatter_cpu(a, s, exec.parallel_for),
                        moe_scatter_cuda(a, s, exec.stream));
}

void moe_gather(const MoeGather& a, const MoeShape& s, const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, moe_gather_cpu(a, s, exec.parallel_for),
                        moe_gather_cuda(a, s, exec.stream));
}

}  // namespace fusedlayers
