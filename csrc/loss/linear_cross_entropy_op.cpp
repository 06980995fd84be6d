// Linear + cross-entropy: argument checks, the chunk size and the loop over row chunks
// (contract: linear_cross_entropy.h).
#include <algorithm>
#include <cmath>

#include "loss/linear_cross_entropy.h"

namespace fusedlayers {
namespace {

constexpr const char* kOp = "linear_cross_entropy";
// The chunk's size (linear_cross_entropy_chunk_rows). A chunk's three GEMMs come near the rate
// of the whole batch's only at thousands of rows (the dX GEMM's rows x H outputs fill the GPU in
// whole waves; dW's read-modify-write per chunk is amortized over a GEMM of that depth), so
// chunks are as large as the memory bound allows, up to kMaxChunkRows: a chunk's logits take at
// most twice the input's size plus half the weight's, so that the op's extra memory (dW, dX and
// the chunk) stays within 1.5x of Liger-Kernel's (dW, dX and a chunk of the input's size), and
// at least kChunkLogits (small H, where that bound is a few rows). The rows are split into
// equal chunks, each a multiple of kChunkRowMultiple rows (the GEMMs' row tiles, which a
// partial tile would leave part idle in every chunk) where that stays within the bound.
constexpr int64_t kMaxChunkRows = 4096;
constexpr int64_t kChunkLogits = int64_t(1) << 24;
constexpr int64_t kChunkRowMultiple = 128;

DType loss_dtype(DType t) { return t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

void check_2d(const char* name, const TensorRef& t) {
  if (t.sizes.size != 2)
    arg_error(kOp, std::string(name) + " must be 2-D, got shape " + t.sizes.str());
}

bool computes_grads(const LinearCrossEntropy& a) { return a.grad_scale != nullptr; }

void check_options(double label_smoothing, double softcap, double z_loss) {
  if (!(label_smoothing >= 0 && label_smoothing <= 1))
    arg_error(kOp, "label_smoothing must be in [0, 1], got " + format_number(label_smoothing));
  if (!(softcap >= 0) || !std::isfinite(softcap))
    arg_error(kOp, "softcap must be None or a positive finite number, got " +
                       format_number(softcap));
  if (!(z_loss >= 0) || !std::isfinite(z_loss))
    arg_error(kOp, "z_loss must be a finite number >= 0, got " + format_number(z_loss));
}

void zero_bytes(void* p, size_t bytes, const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, (std::fill_n(static_cast<char*>(p), bytes, 0), 0),
                        (zero_bytes_cuda(p, bytes, exec.stream), 0));
}

}  // namespace

LinearCrossEntropySizes linear_cross_entropy_check(const LinearCrossEntropy& a) {
  check_2d("input", a.input);
  check_2d("linear_weight", a.weight);
  const int64_t n = a.input.sizes[0], h = a.input.sizes[1], v = a.weight.sizes[0];
  if (a.weight.dtype != a.input.dtype)
    arg_error(kOp, std::string("linear_weight must have input's dtype ") +
                       dtype_name(a.input.dtype) + ", got " + dtype_name(a.weight.dtype),
              Error::Kind::kType);
  if (a.weight.sizes[1] != h)
    arg_error(kOp, "linear_weight must be (vocab, " + std::to_string(h) +
                       ") for input's last dim " + std::to_string(h) + ", got shape " +
                       a.weight.sizes.str());
  if (v == 0) arg_error(kOp, "linear_weight must have at least one row (the vocabulary)");
  if (a.bias.defined) {
    if (a.bias.dtype != a.input.dtype)
      arg_error(kOp, std::string("linear_bias must have input's dtype ") +
                         dtype_name(a.input.dtype) + ", got " + dtype_name(a.bias.dtype),
                Error::Kind::kType);
    if (a.bias.sizes.size != 1 || a.bias.sizes[0] != v)
      arg_error(kOp, "linear_bias must be (" + std::to_string(v) + ",), got shape " +
                         a.bias.sizes.str());
  }
  if (a.target_rows != n)
    arg_error(kOp, "target must have one value per input row (" + std::to_string(n) +
                       "), got " + std::to_string(a.target_rows));
  check_options(a.label_smoothing, a.softcap, a.z_loss);
  if (computes_grads(a) && a.grad_scale_rows != 1 && a.grad_scale_rows != n)
    arg_error(kOp, "grad_scale must have 1 or " + std::to_string(n) + " values, got " +
                       std::to_string(a.grad_scale_rows));
  return {n, h, v, linear_cross_entropy_chunk_rows(n, h, v)};
}

int64_t linear_cross_entropy_chunk_rows(int64_t n, int64_t h, int64_t v) {
  v = std::max<int64_t>(v, 1);
  n = std::max<int64_t>(n, 1);
  const int64_t bound = std::max(2 * n * h / v + h / 2, kChunkLogits / v);
  const int64_t limit = std::max<int64_t>(std::min(kMaxChunkRows, bound), 1);
  const int64_t chunks = (n + limit - 1) / limit;
  const int64_t equal = (n + chunks - 1) / chunks;
  const int64_t tiled = (equal + kChunkRowMultiple - 1) / kChunkRowMultiple * kChunkRowMultiple;
  return std::min(n, tiled <= limit ? tiled : equal);
}

void linear_cross_entropy_chunk_check(const TensorRef& logits, const TensorRef& bias,
                                      int64_t target_rows, int64_t grad_scale_rows,
                                      double label_smoothing, double softcap, double z_loss) {
  check_2d("logits", logits);
  const int64_t rows = logits.sizes[0], v = logits.sizes[1];
  if (v == 0) arg_error(kOp, "linear_weight must have at least one row (the vocabulary)");
  if (bias.defined && (bias.dtype != logits.dtype || bias.sizes.size != 1 || bias.sizes[0] != v))
    arg_error(kOp, "linear_bias must be (" + std::to_string(v) + ",) of the logits' dtype, got " +
                       bias.sizes.str() + " " + dtype_name(bias.dtype));
  if (target_rows != rows)
    arg_error(kOp, "target must have one value per input row (" + std::to_string(rows) +
                       "), got " + std::to_string(target_rows));
  if (grad_scale_rows != 0 && grad_scale_rows != 1 && grad_scale_rows != rows)
    arg_error(kOp, "grad_scale must have 1 or " + std::to_string(rows) + " values, got " +
                       std::to_string(grad_scale_rows));
  check_options(label_smoothing, softcap, z_loss);
}

void linear_cross_entropy_chunk(const LinearCrossEntropyChunk& c, const Exec& exec) {
  if (c.dbias_acc && c.grad_scale)
    zero_bytes(c.dbias_acc, size_t(c.vocab) * dtype_size(loss_dtype(c.dtype)), exec);
  FUSEDLAYERS_ON_DEVICE(exec, (linear_cross_entropy_chunk_cpu(c, exec.parallel_for), 0),
                        (linear_cross_entropy_chunk_cuda(c, exec.stream), 0));
}

size_t linear_cross_entropy_workspace_size(const LinearCrossEntropy& a,
                                           LinearCrossEntropySizes s) {
  const size_t logits = size_t(s.chunk_rows) * s.vocab * dtype_size(a.input.dtype);
  const size_t dbias = a.bias.defined && computes_grads(a)
                           ? size_t(s.vocab) * dtype_size(loss_dtype(a.input.dtype))
                           : 0;
  return (logits + 255) / 256 * 256 + dbias;
}

void linear_cross_entropy(const LinearCrossEntropy& a, LinearCrossEntropySizes s,
                          const Exec& exec, const FrameworkGemm& gemm) {
  const DType dt = a.input.dtype;
  const size_t elem = dtype_size(dt);
  char* logits = static_cast<char*>(a.workspace);
  void* dbias_acc = nullptr;
  const bool grads = computes_grads(a), dbias = grads && a.bias.defined;
  if (dbias) {
    const size_t offset = (size_t(s.chunk_rows) * s.vocab * elem + 255) / 256 * 256;
    dbias_acc = logits + offset;
    zero_bytes(dbias_acc, size_t(s.vocab) * dtype_size(loss_dtype(dt)), exec);
  }
  if (grads && s.rows == 0)  // no chunk writes dW: it is zero
    zero_bytes(a.dweight, size_t(s.vocab) * s.hidden * elem, exec);
  const char* input = static_cast<const char*>(a.input.data);
  for (int64_t row0 = 0; row0 < s.rows; row0 += s.chunk_rows) {
    const int64_t rows = std::min(s.chunk_rows, s.rows - row0);
    const Matrix x{input + size_t(row0) * s.hidden * elem, rows, s.hidden, false};
    gemm(x, Matrix{a.weight.data, s.hidden, s.vocab, true}, logits, dt, false);
    const LinearCrossEntropyChunk c{logits, logits, data_if(a.bias), a.target, a.target_int32,
                                    row0, rows, s.vocab, dt, a.ignore_index, a.label_smoothing,
                                    a.softcap, a.z_loss, a.grad_scale, a.grad_scale_rows > 1,
                                    a.loss, dbias_acc};
    FUSEDLAYERS_ON_DEVICE(exec, (linear_cross_entropy_chunk_cpu(c, exec.parallel_for), 0),
                          (linear_cross_entropy_chunk_cuda(c, exec.stream), 0));
    if (!grads) continue;
    const Matrix du{logits, rows, s.vocab, false};
    gemm(du, Matrix{a.weight.data, s.vocab, s.hidden, false},
         static_cast<char*>(a.dinput) + size_t(row0) * s.hidden * elem, dt, false);
    gemm(Matrix{logits, s.vocab, rows, true}, x, a.dweight, dt, row0 > 0);
  }
  if (dbias)
    FUSEDLAYERS_ON_DEVICE(exec, (linear_cross_entropy_dbias_cpu(dbias_acc, a.dbias, s.vocab, dt), 0),
                          (linear_cross_entropy_dbias_cuda(dbias_acc, a.dbias, s.vocab, dt,
                                                           exec.stream), 0));
}

}  // namespace fusedlayers
