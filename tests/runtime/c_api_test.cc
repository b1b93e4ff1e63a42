// The C API against the C++ Runtime it wraps.
#include "questkv/questkv.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "questkv/runtime.h"

extern "C" int qkv_c_smoke(float* out, char* error, size_t error_size);

namespace questkv {
namespace {

TEST(CApi, SessionFromCMatchesTheCppRuntime) {
  std::vector<float> c_out(2 * 4 * 16, NAN);
  char error[256] = {};
  ASSERT_EQ(qkv_c_smoke(c_out.data(), error, sizeof error), 0) << error;
  // The same inputs through the C++ API.
  Config cfg;
  cfg.geometry.layers = 1, cfg.geometry.q_heads = 4, cfg.geometry.kv_heads = 2, cfg.geometry.head_dim = 16;
  cfg.geometry.page_size = 4;
  cfg.policy.token_budget = 16, cfg.policy.sink_pages = 1, cfg.policy.local_pages = 1, cfg.policy.dense_layers = {};
  cfg.max_pages = 64;
  auto rt = Runtime::Create(cfg);
  ASSERT_TRUE(rt.ok());
  std::vector<float> kv(40 * 2 * 16), q(4 * 16), out(4 * 16);
  for (int i = 0; i < int(kv.size()); ++i) kv[i] = float((i * 7919) % 101) / 50.0f - 1.0f;
  for (int i = 0; i < int(q.size()); ++i) q[i] = float((i * 104729) % 37) / 18.0f - 1.0f;
  SeqId s = *(*rt)->CreateSequence();
  ASSERT_TRUE((*rt)->Append(s, 0, kv.data(), kv.data(), 40).ok());
  SeqId ss[] = {s};
  ASSERT_TRUE((*rt)->DecodeAttention(ss, 0, q.data(), out.data()).ok());
  EXPECT_EQ(std::vector<float>(c_out.begin(), c_out.begin() + 64), out);
}

// Stores an int in a C enum field as a C caller may, whatever the enumerators
// (a C++ cast to the enum type would be undefined outside their range).
template <class E>
void StoreInt(E& field, int v) {
  static_assert(sizeof(E) == sizeof(int));
  std::memcpy(&field, &v, sizeof v);
}

TEST(CApi, BadConfigsAreCodesWithMessages) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  cfg.q_heads = 6;
  cfg.kv_heads = 4;
  qkv_runtime* rt = reinterpret_cast<qkv_runtime*>(0x1);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_EQ(rt, nullptr);
  EXPECT_NE(std::string(qkv_create_error()).find("kv_heads"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  StoreInt(cfg.gqa, 7);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  StoreInt(cfg.gqa, -1);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("gqa mode"), std::string::npos) << qkv_create_error();
  EXPECT_EQ(qkv_create(nullptr, &rt), QKV_INVALID_ARGUMENT);
  qkv_config_default(&cfg);
  StoreInt(cfg.backend, 5);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  qkv_config_default(&cfg);
  StoreInt(cfg.summary_dtype, 2);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("summary dtype"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  EXPECT_EQ(cfg.block_selection, QKV_BLOCK_PER_POSITION);
  StoreInt(cfg.block_selection, 2);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("block selection"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  EXPECT_EQ(cfg.rerank, 0.0);
  cfg.rerank = 0.5;
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("rerank"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  EXPECT_EQ(cfg.group_pages, 0);
  cfg.group_pages = 1;
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("group_pages"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  EXPECT_EQ(cfg.unread_bound_mass, 0.0);
  EXPECT_EQ(cfg.adaptive_floor, 0);
  cfg.unread_bound_mass = 1.0;
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("unread_bound_mass"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  EXPECT_EQ(cfg.deadline_skip_limit, 1.0);
  cfg.deadline_skip_limit = -0.5;
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("deadline_skip_limit"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  EXPECT_EQ(cfg.summary_dtype, QKV_SUMMARY_KV);
  cfg.summary_dtype = QKV_SUMMARY_E4M3;
  ASSERT_EQ(qkv_create(&cfg, &rt), QKV_OK) << qkv_create_error();
  qkv_destroy(rt);
  qkv_config_default(&cfg);
  cfg.dtype = QKV_DTYPE_F16;  // the CPU backend stores f32
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_UNIMPLEMENTED);
  qkv_config_default(&cfg);
  ASSERT_EQ(qkv_create(&cfg, &rt), QKV_OK) << qkv_create_error();
  uint64_t one = 0;
  EXPECT_EQ(qkv_sequence_create(rt, &one), QKV_OK);
  EXPECT_EQ(qkv_append_device(rt, one, 0, nullptr, nullptr, 1), QKV_FAILED_PRECONDITION);  // CPU backend
  EXPECT_EQ(qkv_append_draft_device(rt, one, 0, nullptr, nullptr, 1), QKV_FAILED_PRECONDITION);
  const int block_of_one = 1;
  EXPECT_EQ(qkv_decode_block_device(rt, &one, &block_of_one, 1, 0, nullptr, nullptr), QKV_FAILED_PRECONDITION);
  EXPECT_EQ(qkv_cuda_stream(rt), nullptr);  // no stream on the CPU backend
  EXPECT_EQ(qkv_synchronize(rt), QKV_OK);
  EXPECT_EQ(qkv_synchronize(nullptr), QKV_INVALID_ARGUMENT);
  EXPECT_EQ(qkv_cuda_stream(nullptr), nullptr);
  uint64_t seq = 0;
  EXPECT_EQ(qkv_sequence_create(rt, nullptr), QKV_INVALID_ARGUMENT);
  ASSERT_EQ(qkv_sequence_create(rt, &seq), QKV_OK);
  EXPECT_EQ(qkv_sequence_rollback(rt, seq, 1), QKV_OUT_OF_RANGE);
  EXPECT_NE(std::string(qkv_last_error(rt)), "");
  qkv_destroy(rt);
}

// A call refused for a null output pointer creates nothing: the id space and
// the page capacity are as if it was never made.
TEST(CApi, NullOutputPointersCreateNothing) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  cfg.layers = 1, cfg.q_heads = 2, cfg.kv_heads = 1, cfg.head_dim = 8, cfg.page_size = 4;
  cfg.token_budget = 8, cfg.sink_pages = 1, cfg.local_pages = 1, cfg.num_dense_layers = 0;
  cfg.max_pages = 8;  // 32 tokens
  qkv_runtime* rt = nullptr;
  ASSERT_EQ(qkv_create(&cfg, &rt), QKV_OK) << qkv_create_error();
  uint64_t seq = 0;
  ASSERT_EQ(qkv_sequence_create(rt, &seq), QKV_OK);
  std::vector<float> kv(32 * 8, 0.25f);
  ASSERT_EQ(qkv_append(rt, seq, 0, kv.data(), kv.data(), 6), QKV_OK);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(qkv_sequence_fork(rt, seq, nullptr), QKV_INVALID_ARGUMENT);
    EXPECT_EQ(qkv_sequence_from_prefix(rt, seq, 1, nullptr), QKV_INVALID_ARGUMENT);
    EXPECT_EQ(qkv_sequence_create(rt, nullptr), QKV_INVALID_ARGUMENT);
    EXPECT_EQ(qkv_sequence_length(rt, seq, 0, nullptr), QKV_INVALID_ARGUMENT);
  }
  ASSERT_EQ(qkv_append(rt, seq, 0, kv.data(), kv.data(), 26), QKV_OK) << qkv_last_error(rt);  // all 8 pages
  uint64_t next = 0;
  ASSERT_EQ(qkv_sequence_create(rt, &next), QKV_OK);
  EXPECT_EQ(next, seq + 1);
  qkv_config_default(nullptr);  // no crash
  qkv_destroy(rt);
}

// q == out is allowed on the host API: the result is that of separate buffers.
TEST(CApi, QueriesMayShareTheOutputBuffer) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  qkv_runtime* rt = nullptr;
  ASSERT_EQ(qkv_create(&cfg, &rt), QKV_OK) << qkv_create_error();
  uint64_t seqs[2];
  std::vector<float> kv(300 * cfg.kv_heads * cfg.head_dim);
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(float(i) * 0.37f);
  for (uint64_t& s : seqs) {
    ASSERT_EQ(qkv_sequence_create(rt, &s), QKV_OK);
    for (int l = 0; l < cfg.layers; ++l) ASSERT_EQ(qkv_append(rt, s, l, kv.data(), kv.data() + 7, 290), QKV_OK);
  }
  std::vector<float> q(2 * cfg.q_heads * cfg.head_dim), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(float(i) * 0.11f);
  for (int layer : {0, 3}) {
    ASSERT_EQ(qkv_decode_attention(rt, seqs, 2, layer, q.data(), out.data()), QKV_OK);
    std::vector<float> inout = q;
    ASSERT_EQ(qkv_decode_attention(rt, seqs, 2, layer, inout.data(), inout.data()), QKV_OK);
    EXPECT_EQ(inout, out) << "layer " << layer;
    ASSERT_EQ(qkv_dense_attention(rt, seqs, 2, layer, q.data(), out.data()), QKV_OK);
    inout = q;
    ASSERT_EQ(qkv_dense_attention(rt, seqs, 2, layer, inout.data(), inout.data()), QKV_OK);
    EXPECT_EQ(inout, out) << "layer " << layer;
  }
  qkv_destroy(rt);
}

// sink_pages + local_pages is computed in 64 bits: INT_MAX of either is an
// error, not an overflow that turns decode into dense attention.
TEST(CApi, HugeSinkOrLocalCountsAreRejected) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  cfg.sink_pages = INT_MAX;  // the default budget of 64 pages cannot hold it
  qkv_runtime* rt = nullptr;
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT) << qkv_create_error();
  EXPECT_NE(std::string(qkv_create_error()).find("sink"), std::string::npos) << qkv_create_error();
  qkv_config_default(&cfg);
  cfg.local_pages = INT_MAX;
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT) << qkv_create_error();
  EXPECT_NE(std::string(qkv_create_error()).find("local"), std::string::npos) << qkv_create_error();
}

// Under an address-space limit a runtime sized for 2^30 pages is either made
// (its tables grow with use) or refused with ResourceExhausted; either way
// no exception escapes into the C caller and the process lives.
TEST(CApi, AnAddressSpaceLimitIsAnErrorNotAnAbort) {
  EXPECT_EXIT(
      {
        struct rlimit limit {};
        limit.rlim_cur = limit.rlim_max = rlim_t(1) << 30;
        if (::setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(3);
        qkv_config cfg;
        qkv_config_default(&cfg);
        cfg.max_pages = 1u << 30;
        qkv_runtime* rt = nullptr;
        const qkv_status s = qkv_create(&cfg, &rt);
        if (s == QKV_RESOURCE_EXHAUSTED && rt == nullptr && qkv_create_error()[0] != '\0') std::_Exit(0);
        if (s != QKV_OK) std::_Exit(4);
        uint64_t seq = 0;
        std::vector<float> kv(64 * 2 * 64, 0.5f);
        qkv_status a = qkv_sequence_create(rt, &seq);
        for (int i = 0; i < 4 && a == QKV_OK; ++i) a = qkv_append(rt, seq, 0, kv.data(), kv.data(), 64);
        qkv_destroy(rt);
        std::_Exit(a == QKV_OK || a == QKV_RESOURCE_EXHAUSTED ? 0 : 5);
      },
      ::testing::ExitedWithCode(0), "");
}

// qkv_decode_block verifies a block in one call with the outputs of one
// single-token call after each append.
TEST(CApi, DecodeBlockEqualsSingleTokenCalls) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  qkv_runtime *a = nullptr, *b = nullptr;
  ASSERT_EQ(qkv_create(&cfg, &a), QKV_OK);
  ASSERT_EQ(qkv_create(&cfg, &b), QKV_OK);
  const int row = cfg.kv_heads * cfg.head_dim, qrow = cfg.q_heads * cfg.head_dim, n = 5;
  std::vector<float> kv(1100 * row), q(n * qrow), got(q.size()), want(q.size());
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(float(i) * 0.013f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(float(i) * 0.07f);
  uint64_t sa = 0, sb = 0;
  ASSERT_EQ(qkv_sequence_create(a, &sa), QKV_OK);
  ASSERT_EQ(qkv_sequence_create(b, &sb), QKV_OK);
  const int layer = 3;
  ASSERT_EQ(qkv_append(a, sa, layer, kv.data(), kv.data() + 1, 1000 + n), QKV_OK);
  ASSERT_EQ(qkv_append(b, sb, layer, kv.data(), kv.data() + 1, 1000), QKV_OK);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(qkv_append(b, sb, layer, kv.data() + (1000 + i) * row, kv.data() + 1 + (1000 + i) * row, 1), QKV_OK);
    ASSERT_EQ(qkv_decode_attention(b, &sb, 1, layer, q.data() + i * qrow, want.data() + i * qrow), QKV_OK);
  }
  const int block = n;
  ASSERT_EQ(qkv_decode_block(a, &sa, &block, 1, layer, q.data(), got.data()), QKV_OK) << qkv_last_error(a);
  EXPECT_EQ(got, want);
  EXPECT_EQ(qkv_decode_block(a, &sa, nullptr, 1, layer, q.data(), got.data()), QKV_INVALID_ARGUMENT);
  qkv_destroy(a);
  qkv_destroy(b);
}

// Drafts from C: held off the host until accepted, refused under an
// ordinary append, and kept as the accepted prefix.
TEST(CApi, DraftsAreHeldUntilAccepted) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  cfg.host_bytes = 64ull << 20;  // a host tier whose seals are counted
  qkv_runtime* a = nullptr;
  ASSERT_EQ(qkv_create(&cfg, &a), QKV_OK) << qkv_create_error();
  const int row = cfg.kv_heads * cfg.head_dim, S = cfg.page_size;
  std::vector<float> kv(4 * S * row);
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(float(i) * 0.01f);
  uint64_t s = 0;
  ASSERT_EQ(qkv_sequence_create(a, &s), QKV_OK);
  for (int l = 0; l < cfg.layers; ++l) {  // a rollback takes every layer back
    ASSERT_EQ(qkv_append(a, s, l, kv.data(), kv.data(), S - 1), QKV_OK);
    ASSERT_EQ(qkv_append_draft(a, s, l, kv.data(), kv.data(), 2 * S), QKV_OK);  // fills two pages
  }
  EXPECT_EQ(qkv_append(a, s, 0, kv.data(), kv.data(), 1), QKV_FAILED_PRECONDITION);
  int64_t len = 0;
  ASSERT_EQ(qkv_sequence_length(a, s, 0, &len), QKV_OK);
  EXPECT_EQ(len, 3 * S - 1);
  ASSERT_EQ(qkv_sequence_rollback(a, s, S), QKV_OK);  // keeps S drafts: the first page is full
  ASSERT_EQ(qkv_sequence_accept(a, s), QKV_OK);
  ASSERT_EQ(qkv_sequence_length(a, s, 0, &len), QKV_OK);
  EXPECT_EQ(len, 2 * S - 1);
  EXPECT_EQ(qkv_append(a, s, 0, kv.data(), kv.data(), 1), QKV_OK);
  EXPECT_EQ(qkv_sequence_accept(a, 999), QKV_NOT_FOUND);
  qkv_destroy(a);
}

// QKV_BLOCK_SHARED reaches the runtime: the C call equals the C++ one.
TEST(CApi, SharedBlockSelectionMatchesTheCppRuntime) {
  qkv_config cfg;
  qkv_config_default(&cfg);
  cfg.block_selection = QKV_BLOCK_SHARED;
  qkv_runtime* a = nullptr;
  ASSERT_EQ(qkv_create(&cfg, &a), QKV_OK);
  Config c;
  c.policy.block_selection = BlockSelection::kShared;
  auto b = Runtime::Create(c);
  ASSERT_TRUE(b.ok());
  Config per_position;
  auto p = Runtime::Create(per_position);
  ASSERT_TRUE(p.ok());
  const int row = cfg.kv_heads * cfg.head_dim, qrow = cfg.q_heads * cfg.head_dim, n = 6, layer = 3;
  std::vector<float> kv(3000 * row), q(n * qrow), got(q.size()), want(q.size()), per(q.size());
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = std::sin(float(i) * 0.013f) + std::cos(float(i % 977));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(float(i) * 0.07f);
  uint64_t sa = 0;
  ASSERT_EQ(qkv_sequence_create(a, &sa), QKV_OK);
  const SeqId sb = *(*b)->CreateSequence(), sp = *(*p)->CreateSequence();
  ASSERT_EQ(qkv_append(a, sa, layer, kv.data(), kv.data() + 1, 2900), QKV_OK);
  ASSERT_TRUE((*b)->Append(sb, layer, kv.data(), kv.data() + 1, 2900).ok());
  ASSERT_TRUE((*p)->Append(sp, layer, kv.data(), kv.data() + 1, 2900).ok());
  const int block = n;
  ASSERT_EQ(qkv_decode_block(a, &sa, &block, 1, layer, q.data(), got.data()), QKV_OK) << qkv_last_error(a);
  const SeqId one_b[] = {sb}, one_p[] = {sp};
  ASSERT_TRUE((*b)->DecodeBlock(one_b, std::vector<int>{n}, layer, q.data(), want.data()).ok());
  ASSERT_TRUE((*p)->DecodeBlock(one_p, std::vector<int>{n}, layer, q.data(), per.data()).ok());
  EXPECT_EQ(got, want);
  EXPECT_NE(got, per) << "the shared selection changed nothing here: the test shows nothing";
  qkv_destroy(a);
}

}  // namespace
}  // namespace questkv
