// The Yeo-Johnson lambda search of one column, shared by the CPU and CUDA kernels of
// yeo_johnson_lambdas (csrc/ops/yeo_johnson.cpp). Torch-free: GoogleTest covers it alone.
//
// What scikit-learn's PowerTransformer(method="yeo-johnson").fit computes per column, with the
// installed scikit-learn / SciPy: lambda = 1 for a column whose variance is within the two-pass
// rounding bound of zero (sklearn's _is_constant_feature, a missing value making the variance
// NaN as in np.var), whose non-missing values are all 0, or that has none; otherwise
// scipy.stats.yeojohnson_normmax on the non-missing values: optimize.fminbound (Brent's bounded
// method, xtol 1.48e-8, at most 500 evaluations) of the negative log-likelihood
// n/2*log(var(y)) - (lambda-1)*sum(sign(x)*log1p(|x|)) (+inf when var(y) is below the smallest
// normal), between bounds that keep the transform of 20*max|x| finite. The bounds are about
// +-110 for max|x| = 1 and widen as max|x| shrinks (+-1e11 at 1e-10); the optimum may lie
// anywhere inside them.
#pragma once

#include <cmath>
#include <limits>

#include "string_hash.h"  // TABSERVE_HOST_DEVICE

namespace tabserve {
namespace core {

constexpr double kYJGolden = 0.3819660112501051;     // (3 - sqrt(5)) / 2
constexpr double kYJSqrtEps = 1.4832396974191326e-08;  // sqrt(2.2e-16): SciPy's, not sqrt(eps)
constexpr double kYJXtol = 1.48e-08;
constexpr int kYJMaxEvaluations = 500;
constexpr double kYJEps = 2.220446049250313e-16;     // float64 machine epsilon
constexpr double kYJTiny = 2.2250738585072014e-308;  // smallest normal float64
// (log(tiny) - log(eps)) / 2 and (log(max) + log(eps)) / 2 of float64: yeojohnson_normmax's
// bounds are these over log1p(20 * max|x|).
constexpr double kYJLogTinyHalf = -336.17638257157347;
constexpr double kYJLogMaxHalf = 336.8695297521334;

// Neumaier's compensated sum. The objective is flat near its optimum (on standardised columns of
// 5,000 rows a plain running sum moved lambdas by up to 2e-6 relative from scikit-learn's, whose
// NumPy sums are pairwise); compensated sums keep them within 1e-7.
class CompensatedSum {
 public:
  TABSERVE_HOST_DEVICE void add(double v) {
    const double t = sum_ + v;
    compensation_ += ::fabs(sum_) >= ::fabs(v) ? (sum_ - t) + v : (v - t) + sum_;
    sum_ = t;
  }
  TABSERVE_HOST_DEVICE double value() const { return sum_ + compensation_; }

 private:
  double sum_ = 0, compensation_ = 0;
};

// One entry's transform from its signed log, s = sign(x) * log1p(|x|) (SciPy's formulation:
// expm1(lambda * log1p(x)) / lambda for x >= 0, -expm1((2 - lambda) * log1p(-x)) / (2 - lambda)
// for x < 0, the logarithm where the power is within eps of 0).
TABSERVE_HOST_DEVICE double yeo_johnson_value(double s, double lambda) {
  if (s >= 0) return ::fabs(lambda) < kYJEps ? s : ::expm1(lambda * s) / lambda;
  const double power = 2 - lambda;
  return ::fabs(power) <= kYJEps ? s : -::expm1(-power * s) / power;
}

// The objective from the transformed values' population variance: +inf where the variance is
// below the smallest normal (or NaN) and where the log-likelihood overflows, as SciPy rejects.
TABSERVE_HOST_DEVICE double yeo_johnson_neg_llf(double variance, double count, double lambda,
                                                  double sum_signed_log) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  const double log_var = variance >= kYJTiny ? ::log(variance) : -inf;
  const double llf = -count / 2 * log_var + (lambda - 1) * sum_signed_log;
  return llf == inf || llf == -inf ? inf : -llf;
}

// yeojohnson_normmax's search interval for a column: the largest |x|, and whether some / all of
// its non-missing values are negative.
struct YeoJohnsonBounds {
  double lower, upper;
};

TABSERVE_HOST_DEVICE YeoJohnsonBounds yeo_johnson_bounds(double max_abs, bool any_negative,
                                                           bool all_negative) {
  const double log1p_max = ::log1p(20 * max_abs);
  const double lb = kYJLogTinyHalf / log1p_max, ub = kYJLogMaxHalf / log1p_max;
  if (all_negative) return {2 - ub, 2 - lb};
  if (any_negative) return {lb > 2 - ub ? lb : 2 - ub, ub < 2 - lb ? ub : 2 - lb};
  return {lb, ub};
}

// SciPy's fminbound (optimize._optimize._minimize_scalar_bounded) as a state machine, so that
// the caller evaluates the objective however it likes (a loop on the CPU, a block reduction on
// the GPU, where every thread of the block holds the same state):
//
//   BoundedBrent search(lower, upper);
//   while (search.wants_more()) search.observe(objective(search.point()));
//   result = search.best();
class BoundedBrent {
 public:
  TABSERVE_HOST_DEVICE BoundedBrent(double lower, double upper)
      : a_(lower), b_(upper), xf_(lower + kYJGolden * (upper - lower)) {
    nfc_ = fulc_ = x_ = xf_;
  }

  TABSERVE_HOST_DEVICE bool wants_more() const { return running_; }
  TABSERVE_HOST_DEVICE double point() const { return x_; }
  TABSERVE_HOST_DEVICE double best() const { return xf_; }
  TABSERVE_HOST_DEVICE int evaluations() const { return evaluations_; }

  // The objective's value at point(); then decides whether to go on and, if so, the next point.
  TABSERVE_HOST_DEVICE void observe(double fu) {
    if (evaluations_++ == 0) {
      fx_ = fnfc_ = ffulc_ = fu;
    } else {
      update(fu);
      if (evaluations_ >= kYJMaxEvaluations) {
        running_ = false;
        return;
      }
    }
    const double xm = 0.5 * (a_ + b_);
    const double tol1 = kYJSqrtEps * ::fabs(xf_) + kYJXtol / 3.0, tol2 = 2.0 * tol1;
    // A NaN anywhere (bounds of an all-zero column) ends the search, as SciPy's loop test does.
    running_ = ::fabs(xf_ - xm) > tol2 - 0.5 * (b_ - a_);
    if (running_) next_point(xm, tol1, tol2);
  }

 private:
  TABSERVE_HOST_DEVICE static double sign_or_one(double v) {
    return (v > 0) - (v < 0) + (v == 0);  // np.sign(v) + (v == 0)
  }

  TABSERVE_HOST_DEVICE void next_point(double xm, double tol1, double tol2) {
    bool golden = true;
    if (::fabs(e_) > tol1) {
      // try a parabola through the three best points
      double r = (xf_ - nfc_) * (fx_ - ffulc_);
      double q = (xf_ - fulc_) * (fx_ - fnfc_);
      double p = (xf_ - fulc_) * q - (xf_ - nfc_) * r;
      q = 2.0 * (q - r);
      if (q > 0.0) p = -p;
      q = ::fabs(q);
      r = e_;
      e_ = rat_;
      if (::fabs(p) < ::fabs(0.5 * q * r) && p > q * (a_ - xf_) && p < q * (b_ - xf_)) {
        rat_ = (p + 0.0) / q;
        const double x = xf_ + rat_;
        if ((x - a_) < tol2 || (b_ - x) < tol2) rat_ = tol1 * sign_or_one(xm - xf_);
        golden = false;
      }
    }
    if (golden) {
      e_ = xf_ >= xm ? a_ - xf_ : b_ - xf_;
      rat_ = kYJGolden * e_;
    }
    x_ = xf_ + sign_or_one(rat_) * (::fabs(rat_) > tol1 ? ::fabs(rat_) : tol1);
  }

  TABSERVE_HOST_DEVICE void update(double fu) {
    const double x = x_;
    if (fu <= fx_) {
      if (x >= xf_) a_ = xf_; else b_ = xf_;
      fulc_ = nfc_, ffulc_ = fnfc_;
      nfc_ = xf_, fnfc_ = fx_;
      xf_ = x, fx_ = fu;
      return;
    }
    if (x < xf_) a_ = x; else b_ = x;
    if (fu <= fnfc_ || nfc_ == xf_) {
      fulc_ = nfc_, ffulc_ = fnfc_;
      nfc_ = x, fnfc_ = fu;
    } else if (fu <= ffulc_ || fulc_ == xf_ || fulc_ == nfc_) {
      fulc_ = x, ffulc_ = fu;
    }
  }

  double a_, b_;             // the bracket
  double xf_, fx_ = 0;       // the best point so far and its value
  double nfc_, fnfc_ = 0;    // the second best
  double fulc_, ffulc_ = 0;  // the third
  double x_;                 // the point to evaluate next
  double rat_ = 0, e_ = 0;   // the last step and the one before
  int evaluations_ = 0;
  bool running_ = true;
};

// sklearn's _is_constant_feature on a column's population mean and variance (over all rows,
// missing ones making both NaN: then it is not constant).
TABSERVE_HOST_DEVICE bool yeo_johnson_constant(double mean, double variance, double rows) {
  const double bound = rows * kYJEps * variance + (rows * mean * kYJEps) * (rows * mean * kYJEps);
  return variance <= bound;
}

}  // namespace core
}  // namespace tabserve
