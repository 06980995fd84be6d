// cuBLASLt GEMMs for linear_gelu (plan: linear_gelu.h). Row-major (rows, cols) is column-major
// (cols, rows), so each row-major product C = A B is issued as C^T = B^T A^T.
#include <cublasLt.h>

#include <array>
#include <memory>
#include <unordered_map>

#include "cuda_common.cuh"
#include "linear_gelu.h"

namespace fusedlayers {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(std::string(what) + ": " + cublasLtGetStatusString(status));
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default: fail("linear_gelu: float64 is not supported on CUDA");
  }
}

size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

template <typename T, cublasStatus_t (*Destroy)(T)>
struct Deleter {
  void operator()(T p) const { Destroy(p); }
};
using OpDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                               Deleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               Deleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Pref = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                             Deleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l;
  check(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld), "cublasLtMatrixLayoutCreate");
  return Layout(l);
}

template <typename V>
void set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const V& value) {
  check(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof(value)),
        "cublasLtMatmulDescSetAttribute");
}

template <typename V>
void set(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
         const V& value) {
  check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
        "cublasLtMatmulPreferenceSetAttribute");
}

// The largest power of two up to 256 dividing the address: what cuBLASLt's heuristic must be
// told, or it may pick a kernel whose vector loads need more alignment than a view's offset has.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// Column-major D (rows x cols) = op(A) op(B), ld of D = rows, with an optional epilogue; A is
// a_rows x a_cols as stored (before op), likewise B. bias / aux (ld = rows) as the epilogue needs.
struct Gemm {
  bool trans_a, trans_b;
  int64_t rows, cols, inner;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
};

// What the heuristic's answer depends on. Pointers enter only through their alignment.
using PlanKey = std::array<int64_t, 16>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 1469598103934665603ull;  // FNV-1a over the fields
    for (int64_t v : key) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

struct Plan {
  OpDesc op;
  Layout a, b, d;
  cublasLtMatmulAlgo_t algo;
  bool found;  // false: cuBLASLt has no algorithm for this GEMM and epilogue
};

// The cached plan of `g`. Per host thread, so the descriptor's pointer attributes can be set for
// each call without a lock (autograd runs backwards on its own threads: each thread pays one
// heuristic query per shape). Bounded: a workload with endlessly new shapes starts over.
Plan& plan(const LtContext& lt, DType dtype, const Gemm& g) {
  constexpr size_t kMaxPlans = 1024;
  thread_local std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  int device;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  const PlanKey key{device, g.trans_a, g.trans_b, g.rows, g.cols, g.inner, g.lda, g.ldb,
                    int64_t(dtype), int64_t(g.epilogue), alignment(g.a), alignment(g.b),
                    alignment(g.d), alignment(g.bias), alignment(g.aux),
                    int64_t(lt.workspace_size)};
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) plans.clear();

  const cudaDataType_t type = cuda_type(dtype);
  cublasLtMatmulDesc_t raw_op;
  check(cublasLtMatmulDescCreate(&raw_op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  Plan p{OpDesc(raw_op), nullptr, nullptr, nullptr, {}, false};
  set(raw_op, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_op, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias) set(raw_op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux) {
    set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.rows);
  }
  p.a = g.trans_a ? layout(type, g.inner, g.rows, g.lda) : layout(type, g.rows, g.inner, g.lda);
  p.b = g.trans_b ? layout(type, g.cols, g.inner, g.ldb) : layout(type, g.inner, g.cols, g.ldb);
  p.d = layout(type, g.rows, g.cols, g.rows);
  cublasLtMatmulPreference_t raw_pref;
  check(cublasLtMatmulPreferenceCreate(&raw_pref), "cublasLtMatmulPreferenceCreate");
  Pref pref(raw_pref);
  set(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, lt.workspace_size);
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.a));
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.b));
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.d));
  set(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.d));
  cublasLtMatmulHeuristicResult_t heuristic;
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(lt.handle, raw_op, p.a.get(), p.b.get(), p.d.get(),
                                       p.d.get(), raw_pref, 1, &heuristic, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  p.found = found > 0;
  p.algo = heuristic.algo;
  return plans.emplace(key, std::move(p)).first->second;
}

// Runs g; false when cuBLASLt has no algorithm for it (the caller may try another epilogue).
bool try_matmul(const LtContext& lt, DType dtype, const Gemm& g) {
  Plan& p = plan(lt, dtype, g);
  if (!p.found) return false;
  if (g.bias) set(p.op.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux) set(p.op.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(lt.handle, p.op.get(), &alpha, g.a, p.a.get(), g.b, p.b.get(), &beta, g.d,
                       p.d.get(), g.d, p.d.get(), &p.algo, lt.workspace, lt.workspace_size,
                       lt.stream),
        "cublasLtMatmul");
  return true;
}

void matmul(const LtContext& lt, DType dtype, const Gemm& g) {
  if (!try_matmul(lt, dtype, g))
    fail("linear_gelu: cuBLASLt has no algorithm for this GEMM (" + std::to_string(g.rows) +
         " x " + std::to_string(g.cols) + " x " + std::to_string(g.inner) + ", " +
         dtype_name(dtype) + ")");
}

}  // namespace

void linear_gelu_forward_cuda(const LinearGeluForward& a, GemmSizes s, const LtContext& lt) {
  const auto [m, n, k] = s;
  const void *x = a.x.data, *w = a.weight.data;
  const void* bias = a.bias.defined ? a.bias.data : nullptr;
  void *pre = a.pre, *y = a.y;
  const GeluApprox approx = a.approx;
  const DType dtype = a.x.dtype;
  if (m == 0 || n == 0) return;
  void* h = pre ? pre : y;  // the GEMM's output when the GELU is a separate pass
  if (k == 0) {  // x W^T is all zeros: no GEMM to run
    cuda::check(cudaMemsetAsync(h, 0, size_t(m * n) * dtype_size(dtype), lt.stream),
                "cudaMemsetAsync");
    linear_gelu_epilogue_forward_cuda(h, bias, pre, y, m, n, approx, dtype, lt.stream);
    return;
  }
  // Row-major pre (m x n) = x W^T is column-major pre^T (n x m) = W x^T. B = x (k x m stored);
  // A = W: (out, in) row-major is k x n column-major, transposed; (in, out) is n x k, as is.
  const bool out_in = a.weight_layout == WeightLayout::kOutIn;
  Gemm g{out_in, false, n, m, k, w, out_in ? k : n, x, k, y};
  // cuBLASLt's GELU_AUX epilogues need the aux leading dimension (n) divisible by 8.
  if (approx == GeluApprox::kTanh && n % 8 == 0) {
    g.bias = bias;
    g.aux = pre;
    g.epilogue = pre ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                     : (bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU);
    if (try_matmul(lt, dtype, g)) return;
  }
  g.d = h;
  g.aux = nullptr;
  g.bias = bias;
  g.epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  matmul(lt, dtype, g);
  linear_gelu_epilogue_forward_cuda(h, nullptr, nullptr, y, m, n, approx, dtype, lt.stream);  // h holds pre
}

cublasLtHandle_t linear_gelu_lt_handle() {
  static const cublasLtHandle_t handle = [] {  // initialised once, thread-safely
    cublasLtHandle_t h = nullptr;
    check(cublasLtCreate(&h), "cublasLtCreate");
    return h;
  }();
  return handle;
}

size_t linear_gelu_backward_workspace_size_cuda(GemmSizes s, DType dtype) {
  const int64_t m = s.m, n = s.n;
  const size_t dpre = (size_t(m * n) * dtype_size(dtype) + 255) / 256 * 256;
  return dpre + linear_gelu_epilogue_backward_workspace_size_cuda(m, n, dtype);
}

void linear_gelu_backward_cuda(const LinearGeluBackward& a, GemmSizes s, const LtContext& lt) {
  const auto [m, n, k] = s;
  const void *dy = a.dy.data, *x = a.x.data, *w = a.weight.data, *pre = a.pre.data;
  void *dx = a.dx, *dw = a.dweight, *workspace = a.workspace;
  void* dbias = a.has_bias ? a.dbias : nullptr;
  const GeluApprox approx = a.approx;
  const DType dtype = a.x.dtype;
  if (n > 0 && !workspace) fail("linear_gelu_backward: workspace is null");  // 0 bytes if n = 0
  char* dpre = static_cast<char*>(workspace);
  void* slabs = dpre + (size_t(m * n) * dtype_size(dtype) + 255) / 256 * 256;
  linear_gelu_epilogue_backward_cuda(dy, pre, dpre, dbias, slabs, m, n, approx, dtype, lt.stream);
  if (k == 0) return;  // dx and dw are empty
  if (m == 0 || n == 0) {  // dpre is empty: dx = 0, dW = 0
    cuda::check(cudaMemsetAsync(dx, 0, size_t(m * k) * dtype_size(dtype), lt.stream), "memset");
    cuda::check(cudaMemsetAsync(dw, 0, size_t(n * k) * dtype_size(dtype), lt.stream), "memset");
    return;
  }
  const bool out_in = a.weight_layout == WeightLayout::kOutIn;
  // dgrad, row-major dx (m x k) = dpre W: column-major dx^T (k x m) = W^T dpre^T, B = dpre (n x m
  // stored); A = W^T: (out, in) row-major is k x n column-major as is; (in, out) is n x k,
  // transposed.
  matmul(lt, dtype, {!out_in, false, k, m, n, w, out_in ? k : n, dpre, n, dx});
  if (out_in) {
    // wgrad, row-major dW (n x k) = dpre^T x: column-major dW^T (k x n) = x^T dpre, A = x (k x m
    // stored), B = dpre (n x m stored, transposed).
    matmul(lt, dtype, {false, true, k, n, m, x, k, dpre, n, dw});
  } else {
    // wgrad in W's (in, out) layout, row-major dW^T (k x n): column-major dW (n x k) = dpre^T x,
    // A = dpre (n x m stored), B = x (k x m stored, transposed).
    matmul(lt, dtype, {false, true, n, k, m, dpre, n, x, k, dw});
  }
}

}  // namespace fusedlayers
