// GoogleTest: csrc/core/yeo_johnson.h, the bounded Brent search and the transform's pieces.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "core/yeo_johnson.h"

using namespace tabserve::core;

namespace {

struct Result {
  double best;
  int evaluations;
};

Result minimise(const std::function<double(double)>& f, double lower, double upper) {
  BoundedBrent search(lower, upper);
  while (search.wants_more()) search.observe(f(search.point()));
  return {search.best(), search.evaluations()};
}

}  // namespace

TEST(BoundedBrent, FindsInteriorMinimaToTheTolerance) {
  for (const double target : {-3.7, 0.0, 0.25, 1.0, 42.5}) {
    const auto result = minimise([&](double x) { return (x - target) * (x - target) + 1; },
                                 -50.0, 60.0);
    const double tolerance = 2 * (kYJSqrtEps * std::fabs(target) + kYJXtol / 3);
    EXPECT_NEAR(result.best, target, 10 * tolerance) << target;
    EXPECT_LT(result.evaluations, 40) << target;  // a parabola fits a quadratic at once
  }
}

TEST(BoundedBrent, NonSmoothAndBoundaryMinima) {
  EXPECT_NEAR(minimise([](double x) { return std::fabs(x - 1.5); }, -4.0, 9.0).best, 1.5, 1e-6);
  // the minimum at a bound: the search ends next to it, never outside the bracket
  const auto edge = minimise([](double x) { return x; }, 2.0, 3.0);
  EXPECT_GE(edge.best, 2.0);
  EXPECT_NEAR(edge.best, 2.0, 1e-6);
}

TEST(BoundedBrent, StopsAtTheEvaluationCapAndOnNaN) {
  // A function that never lets the bracket shrink fast still ends at SciPy's cap.
  int calls = 0;
  const auto capped = minimise(
      [&](double x) {
        ++calls;
        return std::sin(1e9 * x);
      },
      -1e11, 1e11);
  EXPECT_LE(capped.evaluations, kYJMaxEvaluations);
  EXPECT_EQ(capped.evaluations, calls);
  // Infinite bounds (an all-zero column's) give NaN points: one evaluation, then it stops.
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(minimise([](double x) { return x; }, -inf, inf).evaluations, 1);
}

TEST(YeoJohnson, ValueMatchesTheClosedForms) {
  for (const double x : {-3.0, -0.5, 0.0, 0.7, 12.0}) {
    const double s = x < 0 ? -std::log1p(-x) : std::log1p(x);
    for (const double lambda : {-1.5, 0.0, 0.5, 1.0, 2.0, 3.0}) {
      double expected;
      if (x >= 0) {
        expected = lambda == 0 ? std::log1p(x) : (std::pow(x + 1, lambda) - 1) / lambda;
      } else {
        expected = lambda == 2 ? -std::log1p(-x)
                               : -(std::pow(1 - x, 2 - lambda) - 1) / (2 - lambda);
      }
      EXPECT_NEAR(yeo_johnson_value(s, lambda), expected, 1e-12 * (1 + std::fabs(expected)))
          << x << " " << lambda;
    }
  }
  EXPECT_DOUBLE_EQ(yeo_johnson_value(std::log1p(3.0), 1.0), 3.0);  // lambda 1 is the identity
}

TEST(YeoJohnson, ObjectiveRejectsTinyVarianceAndOverflow) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(yeo_johnson_neg_llf(0.0, 10, 1.0, 3.0), inf);
  EXPECT_EQ(yeo_johnson_neg_llf(std::nan(""), 10, 1.0, 3.0), inf);
  EXPECT_EQ(yeo_johnson_neg_llf(1.0, 10, 1e308, 1e308), inf);
  EXPECT_DOUBLE_EQ(yeo_johnson_neg_llf(std::exp(2.0), 10, 3.0, 1.5), 10.0 / 2 * 2.0 - 2.0 * 1.5);
}

TEST(YeoJohnson, BoundsKeepTheLargestValueFinite) {
  const auto positive = yeo_johnson_bounds(1.0, false, false);
  EXPECT_NEAR(positive.upper, kYJLogMaxHalf / std::log1p(20.0), 1e-12);
  EXPECT_NEAR(positive.lower, kYJLogTinyHalf / std::log1p(20.0), 1e-12);
  const auto negative = yeo_johnson_bounds(1.0, true, true);  // mirrored around 1
  EXPECT_DOUBLE_EQ(negative.lower, 2 - positive.upper);
  EXPECT_DOUBLE_EQ(negative.upper, 2 - positive.lower);
  const auto mixed = yeo_johnson_bounds(1.0, true, false);  // the intersection of both
  EXPECT_DOUBLE_EQ(mixed.lower, std::fmax(positive.lower, negative.lower));
  EXPECT_DOUBLE_EQ(mixed.upper, std::fmin(positive.upper, negative.upper));
  EXPECT_GT(yeo_johnson_bounds(1e-10, false, false).upper, 1e10);  // small scales widen them
}

TEST(YeoJohnson, ConstantColumnsFollowTheRoundingBound) {
  EXPECT_TRUE(yeo_johnson_constant(3.0, 0.0, 4));
  EXPECT_TRUE(yeo_johnson_constant(1e6, 1e-25, 100));  // rounding noise of a constant column
  EXPECT_FALSE(yeo_johnson_constant(0.0, 1e-3, 100));
  EXPECT_FALSE(yeo_johnson_constant(std::nan(""), std::nan(""), 4));  // a missing value
}
