// csrc with no framework: the CPU kernels of every op behind their entry points, driven from plain
// C++ with a std::thread parallel-for, against float64 references written here. Built and run by
// tests/test_csrc.py (so by CI): `csrc_test <seed>` exits 0 when every check holds.
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "optimizer/adamw.h"
#include "gemm/linear_gelu_epilogue.h"
#include "util/cpu_types.h"
#include "activation/gated.h"
#include "norm/layer_norm.h"
#include "gemm/linear_gelu.h"
#include "moe/moe.h"
#include "activation/relu_scale.h"
#include "norm/rms_norm.h"
#include "rope/rope.h"

using namespace fusedlayers;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL %s\n", what.c_str());
    ++failures;
  }
}

// max |got - want| / (atol + rtol |want|) <= 1
template <typename T>
void expect_close(const std::vector<T>& got, const std::vector<double>& want, double atol,
                  double rtol, const std::string& what) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::abs(double(got[i]) - want[i]) / (atol + rtol * std::abs(want[i])));
  expect(worst <= 1, what + ": error " + std::to_string(worst) + " x tolerance");
}

// Splits [0, n) into `threads` contiguous ranges, each on its own std::thread.
Exec threads_exec(int threads) {
  return Exec::cpu([threads](int64_t n, int64_t grain, const RangeFn& fn) {
    const int64_t step = std::max<int64_t>(grain, (n + threads - 1) / threads);
    std::vector<std::thread> pool;
    for (int64_t b = 0; b < n; b += step) pool.emplace_back(fn, b, std::min(n, b + step));
    for (auto& t : pool) t.join();
  });
}

template <typename Fn>
void expect_error(Fn&& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
  } catch (const Error& e) {
    expect(std::string(e.what()).find(needle) != std::string::npos,
           what + ": message '" + e.what() + "' lacks '" + needle + "'");
    return;
  }
  expect(false, what + ": no Error thrown");
}

// A view of v with sizes `shape` (which must outlive it, as a binding's sizes do).
TensorRef ref(std::vector<float>& v, const std::vector<int64_t>& shape) {
  return {v.data(), DType::kFloat32, {shape.data(), int64_t(shape.size())}, true};
}

std::vector<float> randn(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void relu_scale_test(std::mt19937_64& rng) {
  const int64_t n = 1001;
  const std::vector<int64_t> shape{7, 143};
  std::vector<float> x = randn(rng, n), y(n), dy = randn(rng, n), dx(n);
  x[3] = 0.0f;
  x[5] = NAN;
  std::vector<uint32_t> mask(relu_scale_mask_words(n));
  const double alpha = 1.7;
  ReluScaleForward f{ref(x, shape), alpha, y.data(), mask.data()};
  relu_scale_forward_check(f);
  relu_scale_forward(f, threads_exec(3));
  const std::vector<int64_t> mshape{int64_t(mask.size())};
  ReluScaleBackward b{ref(dy, shape), mask.data(), {mshape.data(), 1}, alpha, dx.data()};
  relu_scale_backward_check(b);
  relu_scale_backward(b, threads_exec(3));
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = float(alpha);
    const float want = std::isnan(x[i]) ? NAN : std::max(x[i], 0.0f) * a;  // relu(x) * alpha
    ok &= std::isnan(want) ? std::isnan(y[i]) : y[i] == want;
    ok &= dx[i] == (x[i] <= 0.0f ? 0.0f : dy[i] * a);
  }
  expect(ok, "relu_scale forward and backward equal relu(x) * alpha and its gradient");
  expect_error([&] { relu_scale_forward_check({ref(x, shape), NAN}); }, "alpha must be finite",
               "relu_scale NaN alpha");
  const std::vector<int64_t> short_mask{int64_t(mask.size()) - 1};
  b.mask_sizes = {short_mask.data(), 1};
  expect_error([&] { relu_scale_backward_check(b); }, "mask must have shape [32]",
               "relu_scale short mask");
}

// swiglu and geglu (tanh) on the halves of one (rows, 2 cols) buffer, forward and backward,
// against float64.
void gated_test(std::mt19937_64& rng) {
  const int64_t rows = 9, cols = 301;
  const std::vector<int64_t> shape{rows, cols};
  std::vector<float> h = randn(rng, 2 * rows * cols), dy = randn(rng, rows * cols);
  for (auto& v : h) v *= 3;
  for (GatedActivation act : {GatedActivation::kSilu, GatedActivation::kGeluTanh}) {
    std::vector<float> y(rows * cols), dg(rows * cols), du(rows * cols);
    TensorRef gate{h.data(), DType::kFloat32, {shape.data(), 2}, true};
    TensorRef up{h.data() + cols, DType::kFloat32, {shape.data(), 2}, true};
    GatedForward f{{gate, 2 * cols}, {up, 2 * cols}, act, y.data()};
    const RowsCols rc = gated_forward_check("swiglu", f);
    gated_forward(f, rc, threads_exec(3));
    GatedBackward b{ref(dy, shape), {gate, 2 * cols}, {up, 2 * cols}, act, dg.data(), du.data()};
    gated_backward_check("swiglu_backward", b);
    gated_backward(b, rc, threads_exec(3));
    std::vector<double> wy, wg, wu;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const double g = h[r * 2 * cols + c], u = h[r * 2 * cols + cols + c];
        const double d = dy[r * cols + c];
        double a, da;
        if (act == GatedActivation::kSilu) {
          const double s = 1 / (1 + std::exp(-g));
          a = g * s;
          da = s * (1 + g * (1 - s));
        } else {
          const double k = 0.7978845608028654, z = k * (g + 0.044715 * g * g * g);
          const double t = std::tanh(z);
          a = 0.5 * g * (1 + t);
          da = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g);
        }
        wy.push_back(a * u);
        wu.push_back(d * a);
        wg.push_back(d * u * da);
      }
    const std::string name = act == GatedActivation::kSilu ? "swiglu" : "geglu";
    expect_close(y, wy, 1e-6, 1e-5, name + " forward");
    expect_close(du, wu, 1e-6, 1e-5, name + " dup");
    expect_close(dg, wg, 1e-5, 1e-5, name + " dgate");
  }
  const std::vector<int64_t> other{rows, cols + 1};
  std::vector<float> y(rows * cols);
  expect_error([&] {
    gated_forward_check("swiglu", {{ref(dy, shape)}, {ref(y, other)}});
  }, "up must have gate's shape [9, 301], got [9, 302]", "swiglu shape mismatch");
}

// rope on (batch, heads, seq, head_dim) q and k of different head counts, partial rotary,
// forward against float64 and the backward as its transpose (<dy, rope(x)> = <rope^T(dy), x>).
void rope_test(std::mt19937_64& rng) {
  const int64_t b = 2, hq = 3, hk = 1, s = 5, d = 12, r = 8;
  const std::vector<int64_t> qs{b, hq, s, d}, ks{b, hk, s, d}, cs{1, s, r};
  std::vector<float> q = randn(rng, b * hq * s * d), k = randn(rng, b * hk * s * d);
  std::vector<float> cos(s * r), sin(s * r);
  for (int64_t i = 0; i < s * r; ++i) {
    const double angle = 0.37 * double(i) - 1.1;
    cos[i] = float(std::cos(angle));
    sin[i] = float(std::sin(angle));
  }
  const RopeArgs a{ref(q, qs), ref(k, ks), ref(cos, cs), ref(sin, cs), 1, false};
  const RopeShape shape = rope_check("rope", a);
  auto view = [&](std::vector<float>& v, int64_t heads) {
    return RopeView{v.data(), heads, heads * s * d, s * d, d};
  };
  std::vector<float> qe(q.size()), ke(k.size()), dq(q.size()), dk(k.size());
  RopePass p{DType::kFloat32, DType::kFloat32, shape, cos.data(), sin.data(), 0, r,
             view(q, hq), view(k, hk), view(qe, hq), view(ke, hk), false, false};
  rope(p, threads_exec(3));
  std::vector<double> want;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t si = 0; si < s; ++si)
        for (int64_t j = 0; j < d; ++j) {
          const float* x = &q[((bi * hq + h) * s + si) * d];
          if (j >= r) {
            want.push_back(x[j]);
            continue;
          }
          const double rot = j < r / 2 ? -double(x[j + r / 2]) : double(x[j - r / 2]);
          want.push_back(x[j] * double(cos[si * r + j]) + rot * double(sin[si * r + j]));
        }
  expect_close(qe, want, 1e-6, 1e-6, "rope forward");
  // the backward is the transpose: <dy, rope(x)> == <rope_backward(dy), x>
  std::vector<float> dy = randn(rng, q.size()), dyk(k.size(), 0.0f);
  RopePass bp{DType::kFloat32, DType::kFloat32, shape, cos.data(), sin.data(), 0, r,
              view(dy, hq), view(dyk, hk), view(dq, hq), view(dk, hk), false, true};
  rope(bp, threads_exec(2));
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    lhs += double(dy[i]) * qe[i];
    rhs += double(dq[i]) * q[i];
  }
  expect(std::abs(lhs - rhs) <= 1e-4 * (1 + std::abs(lhs)), "rope backward is the transpose");
  const std::vector<int64_t> odd{1, s, 7};
  expect_error([&] { rope_check("rope", {ref(q, qs), ref(k, ks), ref(cos, odd), ref(sin, odd)}); },
               "rotary_dim (cos.shape[-1]) must be even", "rope odd rotary_dim");
}

// LayerNorm and RMSNorm forward and backward against float64, and dweight bitwise equal for one
// and four threads.
void norm_test(std::mt19937_64& rng, bool rms) {
  const int64_t rows = 37, cols = 1000;
  const std::vector<int64_t> shape{rows, cols}, nshape{cols}, sshape{rows};
  std::vector<float> x = randn(rng, rows * cols), w = randn(rng, cols), bias = randn(rng, cols);
  std::vector<float> dy = randn(rng, rows * cols), y(rows * cols), mean(rows), rstd(rows);
  const double eps = 1e-5;
  const Sizes ns{nshape.data(), 1};
  RowsCols rc;
  if (rms) {
    RmsNormForward f{ref(x, shape), ns, ref(w, nshape), eps, false, y.data(), rstd.data()};
    rc = rms_norm_forward_check(f);
    rms_norm_forward(f, rc, threads_exec(2));
  } else {
    LayerNormForward f{ref(x, shape), ns, ref(w, nshape), ref(bias, nshape), eps, false};
    f.y = y.data();
    f.mean = mean.data();
    f.rstd = rstd.data();
    rc = layer_norm_forward_check(f);
    layer_norm_forward(f, rc, threads_exec(2));
  }
  std::vector<double> y_ref(rows * cols), dx_ref(rows * cols), dw_ref(cols, 0), db_ref(cols, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = &x[r * cols];
    double mu = 0, var = 0;
    if (!rms) {
      for (int64_t j = 0; j < cols; ++j) mu += xr[j];
      mu /= cols;
    }
    for (int64_t j = 0; j < cols; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    const double rs = 1 / std::sqrt(var / cols + eps);
    double mg = 0, mgx = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const double xhat = (xr[j] - mu) * rs, g = dy[r * cols + j] * double(w[j]);
      y_ref[r * cols + j] = xhat * w[j] + (rms ? 0 : bias[j]);
      mg += g / cols;
      mgx += g * xhat / cols;
      dw_ref[j] += dy[r * cols + j] * xhat;
      db_ref[j] += dy[r * cols + j];
    }
    for (int64_t j = 0; j < cols; ++j) {
      const double xhat = (xr[j] - mu) * rs, g = dy[r * cols + j] * double(w[j]);
      dx_ref[r * cols + j] = rs * (g - (rms ? 0 : mg) - xhat * mgx);
    }
  }
  const std::string name = rms ? "rms_norm" : "layer_norm";
  expect_close(y, y_ref, 1e-5, 1e-5, name + " forward");
  std::vector<float> dw_once;
  for (int threads : {1, 4}) {
    std::vector<float> dx(rows * cols), dw(cols), db(cols);
    const Exec exec = threads_exec(threads);
    size_t bytes;
    std::vector<char> ws;
    if (rms) {
      RmsNormBackward b{ref(dy, shape), ref(x, shape), ref(rstd, sshape), ns, ref(w, nshape)};
      b.dx = dx.data();
      b.dweight = dw.data();
      rms_norm_backward_check(b);
      bytes = rms_norm_backward_workspace_size(b, rc, exec);
      ws.resize(bytes);
      b.workspace = ws.data();
      rms_norm_backward(b, rc, exec);
    } else {
      LayerNormBackward b{ref(dy, shape), ref(x, shape), ref(mean, sshape), ref(rstd, sshape),
                          ns, ref(w, nshape), ref(bias, nshape)};
      b.dx = dx.data();
      b.dweight = dw.data();
      b.dbias = db.data();
      layer_norm_backward_check(b);
      bytes = layer_norm_backward_workspace_size(b, rc, exec);
      ws.resize(bytes);
      b.workspace = ws.data();
      layer_norm_backward(b, rc, exec);
      expect_close(db, db_ref, 1e-4, 1e-5, name + " dbias");
    }
    expect_close(dx, dx_ref, 1e-5, 1e-4, name + " dx");
    expect_close(dw, dw_ref, 1e-4, 1e-5, name + " dweight");
    if (dw_once.empty())
      dw_once = dw;
    else
      expect(dw == dw_once, name + " dweight is the same bits for 1 and 4 threads");
  }
  const std::vector<int64_t> wrong{cols + 1};
  expect_error([&] { layer_norm_forward_check({ref(x, shape), {wrong.data(), 1}}); },
               "must equal normalized_shape [1001], got x of shape [37, 1000]",
               name + " wrong normalized_shape");
}

// The float16 LayerNorm backward (conversions in registers, one variant per ISA: cpu_vec.h)
// against float64 on the same float16 inputs, with float32 gamma/beta, at a width with no full
// vector and one with a partial last block of 32 columns; the same bits for 1 and 4 threads.
// Returns an FNV-1a digest of every output's bits: tests/test_csrc.py requires it to be the
// same under each FUSEDLAYERS_CPU_ISA.
uint64_t half_layer_norm_test(std::mt19937_64& rng) {
  uint64_t digest = 14695981039346656037ull;
  const auto mix = [&](const void* p, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i)
      digest = (digest ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  };
  for (const int64_t cols : {int64_t(5), int64_t(1000)}) {
    const int64_t rows = 37;
    const std::vector<int64_t> shape{rows, cols}, nshape{cols}, sshape{rows};
    const auto halves = [&](size_t n, float scale, float offset) {
      std::vector<cpu::Half> h(n);
      const std::vector<float> v = randn(rng, n);
      for (size_t i = 0; i < n; ++i) h[i] = cpu::from_acc<cpu::Half>(offset + scale * v[i]);
      return h;
    };
    std::vector<cpu::Half> x = halves(rows * cols, 3, 2), dy = halves(rows * cols, 1, 0);
    std::vector<float> w = randn(rng, cols), bias = randn(rng, cols), mean(rows), rstd(rows);
    std::vector<cpu::Half> y(rows * cols);
    const auto half_ref = [](std::vector<cpu::Half>& v, const std::vector<int64_t>& sizes) {
      return TensorRef{v.data(), DType::kFloat16, {sizes.data(), int64_t(sizes.size())}, true};
    };
    const Sizes ns{nshape.data(), 1};
    LayerNormForward f{half_ref(x, shape), ns, ref(w, nshape), ref(bias, nshape), 1e-5, false};
    f.y = y.data();
    f.mean = mean.data();
    f.rstd = rstd.data();
    const RowsCols rc = layer_norm_forward_check(f);
    layer_norm_forward(f, rc, threads_exec(2));
    std::vector<double> dx_ref(rows * cols), dw_ref(cols, 0), db_ref(cols, 0);
    for (int64_t r = 0; r < rows; ++r) {  // from the saved float32 mean and rstd, as the kernel
      const double mu = mean[r], rs = rstd[r];
      double mg = 0, mgx = 0;
      for (int64_t j = 0; j < cols; ++j) {
        const double xhat = (cpu::to_acc(x[r * cols + j]) - mu) * rs;
        const double d = cpu::to_acc(dy[r * cols + j]);
        mg += d * w[j] / cols;
        mgx += d * w[j] * xhat / cols;
        dw_ref[j] += d * xhat;
        db_ref[j] += d;
      }
      for (int64_t j = 0; j < cols; ++j) {
        const double xhat = (cpu::to_acc(x[r * cols + j]) - mu) * rs;
        dx_ref[r * cols + j] = rs * (cpu::to_acc(dy[r * cols + j]) * w[j] - mg - xhat * mgx);
      }
    }
    std::vector<cpu::Half> dx_once;
    for (int threads : {1, 4}) {
      std::vector<cpu::Half> dx(rows * cols);
      std::vector<float> dw(cols), db(cols);
      const Exec exec = threads_exec(threads);
      LayerNormBackward b{half_ref(dy, shape), half_ref(x, shape), ref(mean, sshape),
                          ref(rstd, sshape), ns, ref(w, nshape), ref(bias, nshape)};
      b.dx = dx.data();
      b.dweight = dw.data();
      b.dbias = db.data();
      layer_norm_backward_check(b);
      std::vector<char> ws(layer_norm_backward_workspace_size(b, rc, exec));
      b.workspace = ws.data();
      layer_norm_backward(b, rc, exec);
      std::vector<float> dx_float(rows * cols);
      for (size_t i = 0; i < dx.size(); ++i) dx_float[i] = cpu::to_acc(dx[i]);
      const std::string name = "float16 layer_norm " + std::to_string(cols) + " wide";
      // dx: one float16 rounding of the result (2^-11 relative) beside float32 sums.
      expect_close(dx_float, dx_ref, 1e-3, 2e-3, name + " dx");
      expect_close(dw, dw_ref, 1e-4, 1e-5, name + " dweight");
      expect_close(db, db_ref, 1e-4, 1e-5, name + " dbias");
      if (dx_once.empty()) {
        dx_once = dx;
        mix(dx.data(), dx.size() * 2);
        mix(dw.data(), dw.size() * 4);
        mix(db.data(), db.size() * 4);
      } else {
        expect(std::memcmp(dx.data(), dx_once.data(), dx.size() * 2) == 0,
               name + " dx is the same bits for 1 and 4 threads");
      }
    }
  }
  return digest;
}

double gelu_ref(double u) { return 0.5 * u * (1 + std::erf(u / std::sqrt(2.0))); }
double gelu_grad_ref(double u) {
  return 0.5 * (1 + std::erf(u / std::sqrt(2.0))) + u * std::exp(-0.5 * u * u) / std::sqrt(2 * M_PI);
}

void linear_gelu_epilogue_test(std::mt19937_64& rng) {
  const int64_t rows = 33, cols = 65;
  const std::vector<int64_t> shape{rows, cols}, bshape{cols};
  std::vector<float> h = randn(rng, rows * cols), bias = randn(rng, cols), dy = randn(rng, rows * cols);
  for (auto& v : h) v *= 4;  // reach both tails
  std::vector<float> pre(rows * cols), y(rows * cols), dpre(rows * cols), dbias(cols);
  const Exec exec = threads_exec(2);
  LinearGeluEpilogueForward f{ref(h, shape), ref(bias, bshape), GeluApprox::kNone, pre.data(), y.data()};
  const RowsCols rc = linear_gelu_epilogue_forward_check("linear_gelu", f);
  linear_gelu_epilogue_forward(f, rc, exec);
  std::vector<double> y_ref(rows * cols), dpre_ref(rows * cols), db_ref(cols, 0);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double u = pre[i];  // the rounded pre-activation, as the unfused layer
    y_ref[i] = gelu_ref(u);
    dpre_ref[i] = dy[i] * gelu_grad_ref(u);
    db_ref[i % cols] += dpre_ref[i];
  }
  expect_close(y, y_ref, 1e-6, 2e-6, "linear_gelu_epilogue forward (erf)");
  LinearGeluEpilogueBackward b{ref(dy, shape), ref(pre, shape), true, GeluApprox::kNone, dpre.data(),
                     dbias.data()};
  linear_gelu_epilogue_backward_check("linear_gelu_backward", b);
  std::vector<char> ws(linear_gelu_epilogue_backward_workspace_size(b, rc, exec));
  b.workspace = ws.data();
  linear_gelu_epilogue_backward(b, rc, exec);
  expect_close(dpre, dpre_ref, 1e-6, 2e-6, "linear_gelu_epilogue dpre");
  expect_close(dbias, db_ref, 1e-5, 1e-5, "linear_gelu_epilogue dbias");
  expect_error([] { parse_gelu_approx("linear_gelu", "erf"); },
               "approximate must be 'none' or 'tanh', got 'erf'", "bad approximate");
  const std::vector<int64_t> w1{cols};
  expect_error([&] { linear_gelu_forward_check({ref(h, shape), ref(bias, w1)}); },
               "weight must be 2-D (out_features, in_features), got shape [65]",
               "linear_gelu 1-D weight");
}

// The whole linear_gelu op on the CPU, its GEMMs a plain loop in double (the callback a binding
// hands in), against float64 sums: forward, dx, dweight (in the weight's layout) and dbias, for
// both weight layouts.
void linear_gelu_test(std::mt19937_64& rng) {
  const int64_t m = 9, k = 13, n = 7;
  const CpuGemm gemm = [](const Matrix& a, const Matrix& b, void* c, DType) {
    const auto at = [](const Matrix& mat, int64_t i, int64_t j) {
      const float* p = static_cast<const float*>(mat.data);
      return double(mat.transposed ? p[j * mat.rows + i] : p[i * mat.cols + j]);
    };
    for (int64_t i = 0; i < a.rows; ++i)
      for (int64_t j = 0; j < b.cols; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < a.cols; ++l) sum += at(a, i, l) * at(b, l, j);
        static_cast<float*>(c)[i * b.cols + j] = float(sum);
      }
  };
  std::vector<float> x = randn(rng, m * k), w = randn(rng, n * k), bias = randn(rng, n),
                     dy = randn(rng, m * n);
  for (const WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    const bool in_out = layout == WeightLayout::kInOut;
    std::vector<float> stored(n * k);  // W (n x k) as stored
    for (int64_t o = 0; o < n; ++o)
      for (int64_t i = 0; i < k; ++i) stored[in_out ? i * n + o : o * k + i] = w[o * k + i];
    const std::vector<int64_t> xs{m, k}, ws{n, k}, bs{n}, ys{m, n};
    std::vector<float> y(m * n), pre(m * n), dx(m * k), dw(n * k), db(n);
    const Exec exec = threads_exec(2);
    LinearGeluForward f{ref(x, xs), ref(stored, ws), layout, ref(bias, bs), GeluApprox::kNone,
                        pre.data(), y.data()};
    const GemmSizes s = linear_gelu_forward_check(f);
    linear_gelu_forward(f, s, exec, {gemm, {}});
    std::vector<double> y_ref(m * n), dpre(m * n), dx_ref(m * k, 0), dw_ref(n * k, 0),
        db_ref(n, 0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t o = 0; o < n; ++o) {
        double u = 0;
        for (int64_t i = 0; i < k; ++i) u += double(x[r * k + i]) * w[o * k + i];
        u = double(float(float(u) + bias[o]));  // the GEMM's float output, then the bias
        y_ref[r * n + o] = gelu_ref(u);
        dpre[r * n + o] = dy[r * n + o] * gelu_grad_ref(u);
        db_ref[o] += dpre[r * n + o];
      }
    for (int64_t r = 0; r < m; ++r)
      for (int64_t o = 0; o < n; ++o)
        for (int64_t i = 0; i < k; ++i) {
          dx_ref[r * k + i] += dpre[r * n + o] * w[o * k + i];
          dw_ref[in_out ? i * n + o : o * k + i] += dpre[r * n + o] * x[r * k + i];
        }
    const std::string name = in_out ? "linear_gelu (in, out) weight" : "linear_gelu";
    expect_close(y, y_ref, 1e-5, 1e-5, name + " forward");
    LinearGeluBackward b{ref(dy, ys), ref(x, xs), ref(stored, ws), ref(pre, ys), layout, true,
                         GeluApprox::kNone, dx.data(), dw.data(), db.data()};
    linear_gelu_backward_check(b);
    std::vector<char> workspace(linear_gelu_backward_workspace_size(b, s, exec));
    b.workspace = workspace.data();
    linear_gelu_backward(b, s, exec, {gemm, {}});
    expect_close(dx, dx_ref, 1e-5, 1e-5, name + " dx");
    expect_close(dw, dw_ref, 1e-5, 1e-5, name + " dweight");
    expect_close(db, db_ref, 1e-5, 1e-5, name + " dbias");
  }
}

// float16 <-> float32 as the kernels convert rows (the CPU's conversion instructions where it has
// them) against the arithmetic conversions of cpu_types.h and, where the compiler has it,
// _Float16: every half, and float32 bit patterns 7919 apart plus each half's rounding edges. The
// same bits, but for NaNs: a NaN stays a NaN of its sign (F16C quiets a signalling one).
template <typename To, typename From>
To bit_cast(From v) {
  To out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

bool same(float a, float b) {
  return std::isnan(a) ? std::isnan(b) && std::signbit(a) == std::signbit(b)
                       : std::memcmp(&a, &b, 4) == 0;
}
bool same(uint16_t a, uint16_t b) {
  const bool nan_a = (a & 0x7fff) > 0x7c00, nan_b = (b & 0x7fff) > 0x7c00;
  return nan_a || nan_b ? nan_a && nan_b && (a >> 15) == (b >> 15) : a == b;
}

void half_conversion_test() {
  std::vector<cpu::Half> halves(65536);
  for (uint32_t i = 0; i < 65536; ++i) halves[i] = cpu::Half{uint16_t(i)};
  std::vector<float> floats(65536);
  cpu::half_to_float(halves.data(), floats.data(), 65536);
  int64_t wrong = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const float want = cpu::to_acc(halves[i]);
    wrong += !same(floats[i], want);
#ifdef __FLT16_MAX__
    wrong += !same(float(bit_cast<_Float16>(uint16_t(i))), want);
#endif
  }
  expect(wrong == 0, "half_to_float on every half: " + std::to_string(wrong) + " wrong");
  std::vector<float> pattern;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 7919)
    pattern.push_back(bit_cast<float>(uint32_t(u)));
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // each half's neighbours and the midpoints to the next
    const uint32_t f = bit_cast<uint32_t>(cpu::to_acc(cpu::Half{uint16_t(h)}));
    for (uint32_t d : {0u, 1u, 0x1000u, 0xfffu, 0x1001u})
      for (uint32_t sign : {0u, 0x80000000u})
        pattern.push_back(bit_cast<float>((f + d) | sign));
  }
  std::vector<cpu::Half> out(pattern.size());
  cpu::float_to_half(pattern.data(), out.data(), int64_t(pattern.size()));
  wrong = 0;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const uint16_t want = cpu::from_acc<cpu::Half>(pattern[i]).bits;
    wrong += !same(out[i].bits, want);
#ifdef __FLT16_MAX__
    wrong += !same(bit_cast<uint16_t>(_Float16(pattern[i])), want);
#endif
  }
  expect(wrong == 0, "float_to_half on " + std::to_string(pattern.size()) + " floats: " +
                         std::to_string(wrong) + " wrong");
}

}  // namespace

// MoE routing: the route (a stable sort by expert, sentinels last), the permute's rows, the
// weighted unpermute and its backward (dys, dweights), against loops in double.
void moe_test(std::mt19937_64& rng) {
  const int64_t tokens = 11, top_k = 3, hidden = 5, experts = 4;
  std::uniform_int_distribution<int64_t> pick(-1, experts);  // -1 and `experts`: no expert
  std::vector<int64_t> idx(tokens * top_k);
  for (auto& e : idx) e = pick(rng);
  const std::vector<int64_t> is{tokens, top_k}, xs_shape{tokens, hidden},
      rows_shape{tokens * top_k, hidden}, ps{tokens * top_k};
  std::vector<float> x = randn(rng, tokens * hidden), w = randn(rng, tokens * top_k),
                     dout = randn(rng, tokens * hidden);
  std::vector<int32_t> rows(tokens * top_k), offsets(experts);
  const IndexRef index{idx.data(), IndexType::kInt64, {is.data(), 2}};
  const IndexRef row_ref{rows.data(), IndexType::kInt32, {ps.data(), 1}};
  const Exec exec = threads_exec(2);
  std::vector<float> xs(tokens * top_k * hidden, -1.0f);
  MoeScatter permute{ref(x, xs_shape), index, row_ref, experts};
  permute.out = xs.data();
  const MoeShape s = moe_scatter_check("moe_permute", permute);
  moe_route({index, experts, rows.data(), offsets.data()}, s, exec);
  moe_scatter(permute, s, exec);
  // the route: pairs by expert, in pair order within one, those of no expert last
  int64_t next = 0;
  for (int64_t e = 0; e <= experts; ++e) {
    for (int64_t p = 0; p < tokens * top_k; ++p) {
      const bool none = idx[p] < 0 || idx[p] >= experts;
      if ((e == experts) == none && (none || idx[p] == e))
        expect(rows[p] == next++, "moe route: pair " + std::to_string(p));
    }
    if (e < experts) expect(offsets[e] == next, "moe offsets " + std::to_string(e));
  }
  std::vector<double> xs_ref(xs.size()), out_ref(tokens * hidden, 0), dys_ref(xs.size());
  std::vector<double> dw_ref(tokens * top_k, 0);
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    const bool none = idx[p] < 0 || idx[p] >= experts;
    for (int64_t i = 0; i < hidden; ++i) {
      const int64_t t = p / top_k, r = rows[p] * hidden + i;
      xs_ref[r] = none ? 0 : x[t * hidden + i];
      if (none) continue;
      out_ref[t * hidden + i] += double(w[p]) * xs[r];
      dys_ref[r] = double(w[p]) * dout[t * hidden + i];
      dw_ref[p] += double(xs[r]) * dout[t * hidden + i];
    }
  }
  expect_close(xs, xs_ref, 0, 0, "moe_permute rows");
  std::vector<float> out(tokens * hidden), dys(xs.size()), dw(tokens * top_k);
  const std::vector<int64_t> ws{tokens, top_k};
  MoeGather unpermute{ref(xs, rows_shape), index, row_ref, experts, ref(w, ws), out.data()};
  moe_gather(unpermute, moe_gather_check("moe_unpermute", unpermute), exec);
  expect_close(out, out_ref, 1e-6, 1e-6, "moe_unpermute");
  MoeScatter backward{ref(dout, xs_shape), index, row_ref, experts, ref(w, ws), ref(xs, rows_shape),
                      dys.data(), dw.data()};
  moe_scatter(backward, moe_scatter_check("moe_unpermute_backward", backward), exec);
  expect_close(dys, dys_ref, 1e-6, 1e-6, "moe_unpermute_backward dys");
  expect_close(dw, dw_ref, 1e-6, 1e-6, "moe_unpermute_backward dweights");
  expect_error([&] { moe_route_check("moe_permute", index, 0); },
               "num_experts must be in [1, 8192], got 0", "moe num_experts");
}

// Three AdamW steps of two float32 parameters (one spanning two chunks) with amsgrad, weight
// decay and clipping, against the update written out here in float64.
void adamw_test(std::mt19937_64& rng) {
  const std::vector<int64_t> sa{kAdamWChunk + 77}, sb{5, 3};
  struct P { std::vector<float> w, g, m, v, vmax; std::vector<double> w64, m64, v64, vmax64; };
  std::vector<P> ps(2);
  const std::vector<int64_t>* shapes[2] = {&sa, &sb};
  for (int j = 0; j < 2; ++j) {
    const size_t n = size_t(Sizes{shapes[j]->data(), int64_t(shapes[j]->size())}.numel());
    ps[j].w = randn(rng, n);
    ps[j].m = ps[j].v = ps[j].vmax = std::vector<float>(n, 0.f);
    ps[j].w64.assign(ps[j].w.begin(), ps[j].w.end());
    ps[j].m64 = ps[j].v64 = ps[j].vmax64 = std::vector<double>(n, 0.0);
  }
  std::vector<float> steps(2, 0.f);
  const std::vector<int64_t> scalar{1};
  AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1, o.amsgrad = true, o.max_grad_norm = 5.0;
  const Exec exec = threads_exec(3);
  for (int t = 1; t <= 3; ++t) {
    std::vector<AdamWTensors> table(2);
    std::vector<TensorRef> grads;
    double sumsq = 0;
    for (int j = 0; j < 2; ++j) {
      ps[j].g = randn(rng, ps[j].w.size());
      for (float g : ps[j].g) sumsq += double(g) * g;
      table[j] = {ref(ps[j].w, *shapes[j]), ref(ps[j].g, *shapes[j]), ref(ps[j].m, *shapes[j]),
                  ref(ps[j].v, *shapes[j]), ref(ps[j].vmax, *shapes[j]), {},
                  {&steps[j], DType::kFloat32, {scalar.data(), 1}, true}};
      grads.push_back(table[j].grad);
    }
    std::vector<double> partials(adamw_grad_sumsq_workspace_size(grads) / sizeof(double));
    double got_sumsq = 0;
    adamw_grad_sumsq_check(grads);
    adamw_grad_sumsq(grads, &got_sumsq, partials.data(), exec);
    expect(std::abs(got_sumsq - sumsq) <= 1e-12 * sumsq, "adamw_grad_sumsq");
    o.grad_sumsq = &got_sumsq;
    adamw_check(table, o);
    adamw_step(table, o, exec);
    const double clip = std::min(1.0, o.max_grad_norm / (std::sqrt(sumsq) + 1e-6));
    for (int j = 0; j < 2; ++j) {
      P& p = ps[j];
      for (size_t i = 0; i < p.w.size(); ++i) {
        const double g = p.g[i] * clip;
        p.w64[i] *= 1 - o.lr * o.weight_decay;
        p.m64[i] += (1 - o.beta1) * (g - p.m64[i]);
        p.v64[i] = o.beta2 * p.v64[i] + (1 - o.beta2) * g * g;
        p.vmax64[i] = std::max(p.vmax64[i], p.v64[i]);
        p.w64[i] -= o.lr / (1 - std::pow(o.beta1, t)) * p.m64[i] /
                    (std::sqrt(p.vmax64[i]) / std::sqrt(1 - std::pow(o.beta2, t)) + o.eps);
      }
      expect_close(p.w, p.w64, 1e-6, 1e-5, "adamw w of params[" + std::to_string(j) + "]");
      expect_close(p.m, p.m64, 1e-7, 1e-5, "adamw exp_avg");
      expect_close(p.vmax, p.vmax64, 1e-9, 1e-5, "adamw max_exp_avg_sq");
      expect(steps[j] == float(t), "adamw step count");
    }
  }
  AdamWOptions bad = o;
  bad.beta2 = 1.0;
  expect_error([&] { adamw_check({}, bad); }, "beta2 must be in [0, 1), got 1", "adamw beta2");
}

int main(int argc, char** argv) {
  const unsigned long long seed = argc > 1 ? std::stoull(argv[1]) : 0;
  std::mt19937_64 rng(seed);
  relu_scale_test(rng);
  gated_test(rng);
  rope_test(rng);
  norm_test(rng, false);
  norm_test(rng, true);
  linear_gelu_epilogue_test(rng);
  linear_gelu_test(rng);
  moe_test(rng);
  adamw_test(rng);
  half_conversion_test();
  const uint64_t half_digest = half_layer_norm_test(rng);
#ifndef FUSEDLAYERS_WITH_CUDA
  std::vector<float> x(4), y(4);
  const std::vector<int64_t> shape{4};
  expect_error([&] { relu_scale_forward({ref(x, shape), 1.0, y.data()}, Exec::gpu(nullptr)); },
               "built without CUDA kernels", "a CUDA Exec in a CPU-only build");
#endif
  std::printf("float16 digest %016llx\n", static_cast<unsigned long long>(half_digest));
  std::printf("%s (seed %llu)\n", failures ? "FAILED" : "all passed", seed);
  return failures ? 1 : 0;
}
