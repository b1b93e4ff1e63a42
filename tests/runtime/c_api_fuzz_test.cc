// Seeded random sequences of C API calls, some of them malformed, against a
// twin runtime that only ever sees the well-formed ones: a refused call must
// change nothing, so both runtimes agree on every id, length, output and
// capacity error.
#include "questkv/questkv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

constexpr int kLayers = 2, kHq = 4, kHkv = 2, kD = 8, kS = 4;

qkv_runtime* Make() {
  qkv_config c;
  qkv_config_default(&c);
  c.layers = kLayers, c.q_heads = kHq, c.kv_heads = kHkv, c.head_dim = kD, c.page_size = kS;
  c.token_budget = 3 * kS, c.sink_pages = 1, c.local_pages = 1;
  static const int kDense[] = {0};
  c.dense_layers = kDense, c.num_dense_layers = 1;
  c.max_pages = 48;  // small, so ResourceExhausted is part of the workload
  qkv_runtime* rt = nullptr;
  EXPECT_EQ(qkv_create(&c, &rt), QKV_OK) << qkv_create_error();
  return rt;
}

class Fuzz {
 public:
  explicit Fuzz(uint64_t seed) : rng_(seed), a_(Make()), b_(Make()) {}
  ~Fuzz() {
    qkv_destroy(a_);
    qkv_destroy(b_);
  }

  void Step() {
    const int op = Pick(9);
    const bool bad = Pick(3) == 0;
    switch (op) {
      case 0: Create(bad); break;
      case 1: Fork(bad); break;
      case 2: FromPrefix(bad); break;
      case 3: Rollback(bad); break;
      case 4: Free(bad); break;
      case 5: case 6: Append(bad); break;
      default: Decode(bad); break;
    }
    ExpectSameLengths();
  }

 private:
  int Pick(int n) { return int(rng_() % uint64_t(n)); }
  uint64_t AnySeq() { return seqs_.empty() ? 1 : seqs_[Pick(int(seqs_.size()))]; }
  uint64_t Unknown() { return 1000000 + rng_() % 1000; }

  // A well-formed call goes to both runtimes, which must answer alike.
  void Both(qkv_status sa, qkv_status sb) { ASSERT_EQ(sa, sb) << qkv_last_error(a_) << " / " << qkv_last_error(b_); }
  // A malformed call goes to `a` only and must be refused.
  void Refused(qkv_status s) { EXPECT_NE(s, QKV_OK) << "a malformed call succeeded"; }

  void Create(bool bad) {
    if (bad) return Refused(qkv_sequence_create(a_, nullptr));
    uint64_t x = 0, y = 0;
    Both(qkv_sequence_create(a_, &x), qkv_sequence_create(b_, &y));
    ASSERT_EQ(x, y) << "the id spaces diverged";
    seqs_.push_back(x);
  }
  void Fork(bool bad) {
    if (bad) return Refused(Pick(2) ? qkv_sequence_fork(a_, AnySeq(), nullptr) : qkv_sequence_fork(a_, Unknown(), &scratch_));
    uint64_t x = 0, y = 0;
    const uint64_t parent = AnySeq();
    const qkv_status s = qkv_sequence_fork(a_, parent, &x);
    Both(s, qkv_sequence_fork(b_, parent, &y));
    if (s == QKV_OK) {
      ASSERT_EQ(x, y);
      seqs_.push_back(x);
    }
  }
  void FromPrefix(bool bad) {
    const uint64_t parent = AnySeq();
    if (bad) {
      switch (Pick(3)) {
        case 0: return Refused(qkv_sequence_from_prefix(a_, parent, 1, nullptr));
        case 1: return Refused(qkv_sequence_from_prefix(a_, parent, -1 - Pick(5), &scratch_));
        default: return Refused(qkv_sequence_from_prefix(a_, parent, 1 << 20, &scratch_));
      }
    }
    uint64_t x = 0, y = 0;
    const int64_t pages = Pick(3);
    const qkv_status s = qkv_sequence_from_prefix(a_, parent, pages, &x);
    Both(s, qkv_sequence_from_prefix(b_, parent, pages, &y));
    if (s == QKV_OK) {
      ASSERT_EQ(x, y);
      seqs_.push_back(x);
    }
  }
  void Rollback(bool bad) {
    if (bad) return Refused(Pick(2) ? qkv_sequence_rollback(a_, AnySeq(), -1) : qkv_sequence_rollback(a_, AnySeq(), 1 << 30));
    const uint64_t seq = AnySeq();
    const int64_t n = Pick(7);
    Both(qkv_sequence_rollback(a_, seq, n), qkv_sequence_rollback(b_, seq, n));
  }
  void Free(bool bad) {
    if (bad) return Refused(qkv_sequence_free(a_, Unknown()));
    if (seqs_.empty() || Pick(2)) return;  // frees are rarer than creations
    const int i = Pick(int(seqs_.size()));
    Both(qkv_sequence_free(a_, seqs_[i]), qkv_sequence_free(b_, seqs_[i]));
    seqs_.erase(seqs_.begin() + i);
  }
  void Append(bool bad) {
    const int64_t n = 1 + Pick(9);
    std::vector<float> k(std::size_t(n) * kHkv * kD), v(k.size());
    std::normal_distribution<float> normal;
    for (float& x : k) x = normal(rng_);
    for (float& x : v) x = normal(rng_);
    const uint64_t seq = AnySeq();
    const int layer = Pick(kLayers);
    if (bad) {
      switch (Pick(5)) {
        case 0: return Refused(qkv_append(a_, seq, layer, nullptr, v.data(), n));
        case 1: return Refused(qkv_append(a_, seq, layer, k.data(), v.data(), 0));
        case 2: return Refused(qkv_append(a_, seq, kLayers + Pick(3), k.data(), v.data(), n));
        case 3: return Refused(qkv_append(a_, Unknown(), layer, k.data(), v.data(), n));
        default: return Refused(qkv_append(nullptr, seq, layer, k.data(), v.data(), n));
      }
    }
    // Every layer gets the same count, as a model would append.
    for (int l = 0; l < kLayers; ++l) Both(qkv_append(a_, seq, l, k.data(), v.data(), n), qkv_append(b_, seq, l, k.data(), v.data(), n));
  }
  void Decode(bool bad) {
    if (seqs_.empty()) return;
    std::vector<uint64_t> batch;
    for (uint64_t s : seqs_)
      if (Pick(2) && Length(a_, s, 1) > 0) batch.push_back(s);
    if (batch.empty()) return;
    std::vector<float> q(batch.size() * kHq * kD), oa(q.size(), NAN), ob(q.size(), NAN);
    std::normal_distribution<float> normal;
    for (float& x : q) x = normal(rng_);
    const int layer = Pick(kLayers);
    if (bad) {
      switch (Pick(4)) {
        case 0: return Refused(qkv_decode_attention(a_, batch.data(), 0, layer, q.data(), oa.data()));
        case 1: return Refused(qkv_decode_attention(a_, nullptr, 1, layer, q.data(), oa.data()));
        case 2: return Refused(qkv_decode_attention(a_, batch.data(), int(batch.size()), -1, q.data(), oa.data()));
        default: return Refused(qkv_decode_attention(a_, batch.data(), int(batch.size()), layer, q.data(), nullptr));
      }
    }
    // One runtime reads q from out (q == out is allowed), the other not.
    std::copy(q.begin(), q.end(), oa.begin());
    Both(qkv_decode_attention(a_, batch.data(), int(batch.size()), layer, oa.data(), oa.data()),
         qkv_decode_attention(b_, batch.data(), int(batch.size()), layer, q.data(), ob.data()));
    ASSERT_EQ(oa, ob);
    for (float x : oa) ASSERT_TRUE(std::isfinite(x));
  }

  int64_t Length(qkv_runtime* rt, uint64_t seq, int layer) {
    int64_t n = -1;
    EXPECT_EQ(qkv_sequence_length(rt, seq, layer, &n), QKV_OK);
    return n;
  }
  void ExpectSameLengths() {
    for (uint64_t s : seqs_)
      for (int l = 0; l < kLayers; ++l) ASSERT_EQ(Length(a_, s, l), Length(b_, s, l)) << "sequence " << s;
  }

  std::mt19937_64 rng_;
  qkv_runtime *a_, *b_;
  std::vector<uint64_t> seqs_;
  uint64_t scratch_ = 0;
};

TEST(CApiFuzz, RefusedCallsChangeNothing) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Fuzz fuzz(seed);
    for (int step = 0; step < 300 && !::testing::Test::HasFatalFailure(); ++step) fuzz.Step();
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
