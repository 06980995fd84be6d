// The rotary embedding: argument checks, then the kernels (contract: rope.h).
#include "rope/rope.h"

namespace fusedlayers {
namespace {

std::string dims_str(const Sizes& s) { return s.str(); }

}  // namespace

RopeShape rope_check(const char* op, const RopeArgs& a) {
  const auto value = [&](const std::string& msg) { arg_error(op, msg); };
  if (a.unsqueeze_dim != 1 && a.unsqueeze_dim != 2)
    value("unsqueeze_dim must be 1 (q, k as (batch, heads, seq, head_dim)) or 2 ((batch, seq, "
          "heads, head_dim)), got " + std::to_string(a.unsqueeze_dim));
  if (a.k.dtype != a.q.dtype)
    arg_error(op, std::string("k must have q's dtype ") + dtype_name(a.q.dtype) + ", got " +
                      dtype_name(a.k.dtype), Error::Kind::kType);
  if (a.cos.dtype != DType::kFloat32 && a.cos.dtype != a.q.dtype)
    arg_error(op, std::string("cos must be float32 or q's dtype ") + dtype_name(a.q.dtype) +
                      ", got " + dtype_name(a.cos.dtype), Error::Kind::kType);
  if (a.sin.dtype != a.cos.dtype)
    arg_error(op, std::string("sin must have cos's dtype ") + dtype_name(a.cos.dtype) + ", got " +
                      dtype_name(a.sin.dtype), Error::Kind::kType);
  const Sizes& q = a.q.sizes;
  const Sizes& k = a.k.sizes;
  if (q.size != 4) value("q must be 4-D, got shape " + dims_str(q));
  if (k.size != 4) value("k must be 4-D, got shape " + dims_str(k));
  const int hd = a.unsqueeze_dim == 1 ? 1 : 2, sd = a.unsqueeze_dim == 1 ? 2 : 1;
  if (k[0] != q[0] || k[sd] != q[sd] || k[3] != q[3])
    value("k must match q's batch, seq and head_dim (" + std::to_string(q[0]) + ", " +
          std::to_string(q[sd]) + ", " + std::to_string(q[3]) + "), got shape " + dims_str(k));
  if (!(a.sin.sizes == a.cos.sizes))
    value("sin must have cos's shape " + dims_str(a.cos.sizes) + ", got " + dims_str(a.sin.sizes));
  const Sizes& c = a.cos.sizes;
  if (c.size != 3 || (c[0] != 1 && c[0] != q[0]) || c[1] != q[sd])
    value("cos must have shape (batch or 1, seq, rotary_dim) = (" + std::to_string(q[0]) +
          " or 1, " + std::to_string(q[sd]) + ", rotary_dim), got " + dims_str(c));
  if (c[2] % 2 != 0 || c[2] > q[3] || c[2] <= 0)
    value("rotary_dim (cos.shape[-1]) must be even, positive and at most head_dim " +
          std::to_string(q[3]) + ", got " + std::to_string(c[2]));
  return {q[0], q[sd], q[3], c[2], q[hd], k[hd]};
}

void rope(const RopePass& p, const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, rope_cpu(p, exec.parallel_for), rope_cuda(p, exec.stream));
}

}  // namespace fusedlayers
