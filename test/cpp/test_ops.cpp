// GoogleTest: the string-lookup, rotary, small-head attention, table-check and LayerNorm-cast
// operators called through the PyTorch dispatcher, as LibTorch users (and TorchScript) see them,
// on CPU.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace {

struct Column {
  at::Tensor data, offsets, valid;
};

Column make_column(const std::vector<std::string>& labels, const std::vector<bool>& valid) {
  std::string bytes;
  std::vector<int64_t> offsets{0};
  for (const auto& s : labels) {
    bytes += s;
    offsets.push_back(static_cast<int64_t>(bytes.size()));
  }
  Column c;
  c.data = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::copy(bytes.begin(), bytes.end(), c.data.data_ptr<uint8_t>());
  c.offsets = at::tensor(offsets, at::kLong);
  c.valid = at::empty({static_cast<int64_t>(valid.size())}, at::kBool);
  for (size_t i = 0; i < valid.size(); ++i) c.valid.data_ptr<bool>()[i] = valid[i];
  return c;
}

auto index_build_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("tabserve::string_index_build", "")
      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                               const std::optional<at::Tensor>&,
                                               const at::Tensor&, int64_t)>();
}

}  // namespace

TEST(DispatcherOps, BuildAndLookup) {
  auto build = index_build_op();
  auto lookup = c10::Dispatcher::singleton()
                    .findSchemaOrThrow("tabserve::string_lookup", "")
                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const std::optional<at::Tensor>&,
                                      int64_t, int64_t, bool)>();
  const Column vocabulary = make_column({"red", "", "blue", "red", "null"},
                                        {true, true, true, true, false});
  const at::Tensor segments = at::tensor(std::vector<int64_t>{0, 5}, at::kLong);
  auto [slot_hash, slot_row] =
      build.call(vocabulary.data, vocabulary.offsets, vocabulary.valid, segments, 64);
  const Column query = make_column({"red", "blue", "", "null", "green", "red"},
                                   {true, true, true, true, true, false});
  const at::Tensor codes = lookup.call(vocabulary.data, vocabulary.offsets, segments, slot_hash,
                                       slot_row, query.data, query.offsets, query.valid, 0, 64,
                                       true);
  const std::vector<int64_t> expected{3, 2, 1, -1, -1, -1};
  ASSERT_EQ(codes.numel(), 6);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(codes.data_ptr<int64_t>()[i], expected[i]) << i;
}

TEST(DispatcherOps, DecreasingOffsetsRaiseNamingTheArgument) {
  auto build = index_build_op();
  const at::Tensor data = at::zeros({4}, at::kByte);
  const at::Tensor offsets = at::tensor(std::vector<int64_t>{0, 3, 1}, at::kLong);
  const at::Tensor segments = at::tensor(std::vector<int64_t>{0, 2}, at::kLong);
  try {
    build.call(data, offsets, std::nullopt, segments, 64);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocabulary_offsets[2]"), std::string::npos) << e.what();
  }
}

// Dictionary-encoded columns: the codes of two columns whose row codes sit in one matrix, read
// through code_columns (column 0 of the result reads codes column 2, column 1 reads column 0).
TEST(DispatcherOps, DictionaryLookupMapsRowCodesThroughTheCategories) {
  auto build = index_build_op();
  auto dictionary =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tabserve::dictionary_lookup", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList,
                            const c10::List<std::optional<at::Tensor>>&, const at::Tensor&,
                            at::OptionalIntArrayRef, int64_t, bool)>();
  // Fitted: column 0 = {a, b, c}, column 1 = {x, y}.
  const Column vocabulary = make_column({"a", "b", "c", "x", "y"}, {true, true, true, true, true});
  const at::Tensor segments = at::tensor(std::vector<int64_t>{0, 3, 5}, at::kLong);
  auto [slot_hash, slot_row] =
      build.call(vocabulary.data, vocabulary.offsets, vocabulary.valid, segments, 64);
  // The batch's own categories: column 0 = {c, z, a}, column 1 = {y, x}.
  const Column first = make_column({"c", "z", "a"}, {true, true, true});
  const Column second = make_column({"y", "x"}, {true, true});
  // Row codes into those categories (-1 null, 3 out of range), three code columns.
  const at::Tensor codes =
      at::tensor(std::vector<int64_t>{1, 9, 0, -1, 9, 2, 0, 9, 3}, at::kLong).view({3, 3});
  c10::List<std::optional<at::Tensor>> valid;
  valid.push_back(first.valid);
  valid.push_back(std::nullopt);
  const std::vector<at::Tensor> data{first.data, second.data};
  const std::vector<at::Tensor> offsets{first.offsets, second.offsets};
  const std::vector<int64_t> code_columns{2, 0};
  const at::Tensor out = dictionary.call(vocabulary.data, vocabulary.offsets, segments, slot_hash,
                                         slot_row, data, offsets, valid, codes, code_columns, 64,
                                         true);
  // Row 0: column 0 reads code 0 -> "c" -> 2; column 1 reads code 1 -> "x" -> 0.
  // Row 1: code 2 -> "a" -> 0; code -1 -> null -> -1.
  // Row 2: code 3 -> out of range -> -1; code 0 -> "y" -> 1.
  const std::vector<int64_t> expected{2, 0, 0, -1, -1, 1};
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 2}));
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(out.data_ptr<int64_t>()[i], expected[i]) << i;
  try {
    dictionary.call(vocabulary.data, vocabulary.offsets, segments, slot_hash, slot_row, data,
                    offsets, valid, codes, std::vector<int64_t>{0, 3}, 64, true);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("code_columns[1]"), std::string::npos) << e.what();
  }
}

namespace {

auto rotary_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("tabserve::rotary_embedding", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
}

}  // namespace

// The one-pass RoPE against the ATen ops it replaces, on a strided head-split view (the row
// stage's layout), float32 and float16.
TEST(DispatcherOps, RotaryEmbeddingEqualsTheComposite) {
  at::manual_seed(0);
  const int64_t length = 9, dim = 16, heads = 4;
  const at::Tensor angles = at::arange(length, at::kFloat).unsqueeze(1) *
                            at::pow(100000.0, -at::arange(0, dim, 2, at::kFloat) / dim).unsqueeze(0);
  const at::Tensor cos = at::cat({angles.cos(), angles.cos()}, -1);
  const at::Tensor sin = at::cat({angles.sin(), angles.sin()}, -1);
  for (const auto dtype : {at::kFloat, at::kHalf}) {
    const at::Tensor packed = at::randn({3, length, 3 * heads * dim}).to(dtype);
    const at::Tensor x =
        packed.narrow(-1, 0, heads * dim).unflatten(-1, {heads, dim}).transpose(-3, -2);
    ASSERT_FALSE(x.is_contiguous());
    const at::Tensor rotated =
        at::cat({-x.narrow(-1, dim / 2, dim / 2), x.narrow(-1, 0, dim / 2)}, -1);
    const at::Tensor expected = (x * cos + rotated * sin).to(dtype);
    const at::Tensor got = rotary_op().call(x, cos, sin);
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_TRUE(at::equal(got, expected)) << dtype;
  }
}

TEST(DispatcherOps, RotaryEmbeddingOddHeadDimensionRaisesNamingIt) {
  const at::Tensor x = at::zeros({2, 5, 7});
  const at::Tensor table = at::zeros({5, 7});
  try {
    rotary_op().call(x, table, table);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be even"), std::string::npos) << e.what();
  }
}

namespace {

auto small_head_attention_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("tabserve::small_head_attention", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, std::optional<double>,
                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
}

}  // namespace

TEST(DispatcherOps, SmallHeadAttentionIsSoftmaxOverTheFirstNKeys) {
  at::manual_seed(0);
  const at::Tensor q = at::randn({2, 8, 5, 16}, at::kDouble);
  const at::Tensor k = at::randn({2, 8, 11, 16}, at::kDouble);
  const at::Tensor v = at::randn({2, 8, 11, 16}, at::kDouble);
  const at::Tensor n = at::tensor({11, 4}, at::kLong);
  const at::Tensor got =
      small_head_attention_op().call(q, k, v, n, std::nullopt, std::nullopt, std::nullopt);
  EXPECT_TRUE(got.transpose(1, 2).is_contiguous());
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t count = n[b].item<int64_t>();
    const at::Tensor scores = at::matmul(q[b], k[b].narrow(1, 0, count).transpose(-1, -2)) * 0.25;
    const at::Tensor expected = at::matmul(at::softmax(scores, -1), v[b].narrow(1, 0, count));
    EXPECT_TRUE(at::allclose(got[b], expected, 1e-12, 1e-12)) << "batch entry " << b;
  }
}

// With RoPE tables: q and k rotated first (dims d and d + 8 pair up), checked against the
// rotation written out here in double precision.
TEST(DispatcherOps, SmallHeadAttentionRotatesQueriesAndKeysFirst) {
  at::manual_seed(1);
  const at::Tensor q = at::randn({1, 2, 6, 16}, at::kDouble);
  const at::Tensor k = at::randn({1, 2, 6, 16}, at::kDouble);
  const at::Tensor v = at::randn({1, 2, 6, 16}, at::kDouble);
  const at::Tensor angles = at::arange(6, at::kDouble).unsqueeze(1) * at::rand({1, 8}, at::kDouble);
  const at::Tensor cos = at::cat({angles.cos(), angles.cos()}, 1).to(at::kFloat);
  const at::Tensor sin = at::cat({angles.sin(), angles.sin()}, 1).to(at::kFloat);
  const auto rotate = [&](const at::Tensor& x) {
    const at::Tensor c = cos.to(at::kDouble), s = sin.to(at::kDouble);
    const at::Tensor lo = x.narrow(3, 0, 8), hi = x.narrow(3, 8, 8);
    return at::cat({lo * c.narrow(1, 0, 8) - hi * s.narrow(1, 0, 8),
                    hi * c.narrow(1, 8, 8) + lo * s.narrow(1, 8, 8)},
                   3);
  };
  const at::Tensor got =
      small_head_attention_op().call(q, k, v, std::nullopt, std::nullopt, cos, sin);
  const at::Tensor scores = at::matmul(rotate(q), rotate(k).transpose(-1, -2)) * 0.25;
  const at::Tensor expected = at::matmul(at::softmax(scores, -1), v);
  EXPECT_TRUE(at::allclose(got, expected, 1e-12, 1e-12));
}

TEST(DispatcherOps, SmallHeadAttentionOtherHeadDimensionRaisesNamingIt) {
  const at::Tensor t = at::zeros({1, 2, 3, 8});
  try {
    small_head_attention_op().call(t, t, t, std::nullopt, std::nullopt, std::nullopt,
                                   std::nullopt);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("q must have head_dim 16"), std::string::npos) << e.what();
  }
}

namespace {

auto table_checks_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("tabserve::table_checks", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>();
}

}  // namespace

// Counts from hand-built labels: table 0 is 0..2 with repeats, table 1 has a gap (no 1), a
// fractional and a negative label; X has one NaN and one infinity.
TEST(DispatcherOps, TableChecksCountFaultsAndDistinctLabels) {
  at::Tensor X = at::zeros({2, 8, 3});
  X[0][1][2] = std::numeric_limits<float>::quiet_NaN();
  X[1][7][0] = std::numeric_limits<float>::infinity();
  const at::Tensor y = at::tensor({0.0, 1.0, 2.0, 2.0, 1.0, 0.0, 0.0, 2.0, 2.0, 0.5, -1.0, 0.0},
                                  at::kDouble)
                           .view({2, 6});
  const at::Tensor got = table_checks_op().call(X, y, true);
  const std::vector<int64_t> expected{2, 0, 0, 3, 2, 2, 2, 2};
  ASSERT_EQ(got.numel(), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(got[static_cast<int64_t>(i)].item<int64_t>(), expected[i]) << "entry " << i;
  }
  const at::Tensor regression = table_checks_op().call(X, y, false);
  EXPECT_EQ(regression[0].item<int64_t>(), 2);
  EXPECT_EQ(regression.narrow(0, 1, 7).abs().sum().item<int64_t>(), 0);
}

TEST(DispatcherOps, TableChecksComplexLabelsRaiseNamingThem) {
  try {
    table_checks_op().call(at::zeros({1, 3, 2}), at::zeros({1, 2}, at::kComplexFloat), true);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("y_train must be bool"), std::string::npos) << e.what();
  }
}

namespace {

auto layer_norm_cast_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("tabserve::layer_norm_cast", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        double, at::ScalarType)>();
}

}  // namespace

// LayerNorm rounded to half precision against the same maths in float64 rounded once: equal on
// nearly every value, never more than one rounding away (fp32 sums against fp64 ones).
TEST(DispatcherOps, LayerNormCastIsFloat64MathsRoundedOnce) {
  at::manual_seed(0);
  const at::Tensor x = at::randn({6, 128}) + 3 * at::randn({6, 1});
  const at::Tensor weight = 1 + 0.2 * at::randn({128});
  const at::Tensor bias = 0.1 * at::randn({128});
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const at::Tensor got = layer_norm_cast_op().call(x, weight, bias, 1e-5, dtype);
    ASSERT_EQ(got.scalar_type(), dtype);
    ASSERT_EQ(got.sizes(), x.sizes());
    const at::Tensor centred = x.to(at::kDouble) - x.to(at::kDouble).mean(-1, true);
    const at::Tensor variance = (centred * centred).mean(-1, true);
    const at::Tensor want =
        (centred / at::sqrt(variance + 1e-5) * weight.to(at::kDouble) + bias.to(at::kDouble))
            .to(dtype);
    const double equal = got.eq(want).to(at::kDouble).mean().item<double>();
    EXPECT_GE(equal, 0.99) << dtype;
    const double eps = dtype == at::kHalf ? 1.0 / 1024 : 1.0 / 128;  // the dtype's epsilon
    const at::Tensor rounding = want.to(at::kDouble).abs().clamp_min(1.0 / 64) * eps;
    EXPECT_LE(((got.to(at::kDouble) - want.to(at::kDouble)).abs() / rounding).max().item<double>(),
              1.0)
        << dtype;
  }
}

TEST(DispatcherOps, LayerNormCastOtherDtypeRaisesNamingIt) {
  try {
    layer_norm_cast_op().call(at::zeros({2, 128}), at::ones({128}), std::nullopt, 1e-5,
                              at::kFloat);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype must be float16 or bfloat16"), std::string::npos)
        << e.what();
  }
}
