// The C API against the C++ Runtime it wraps.
#include "runtime/questkv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "runtime/runtime.h"

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
  cfg.gqa = static_cast<qkv_gqa_mode>(7);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_EQ(qkv_create(nullptr, &rt), QKV_INVALID_ARGUMENT);
  qkv_config_default(&cfg);
  cfg.backend = static_cast<qkv_backend>(5);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  qkv_config_default(&cfg);
  cfg.summary_dtype = static_cast<qkv_summary_dtype>(2);
  EXPECT_EQ(qkv_create(&cfg, &rt), QKV_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qkv_create_error()).find("summary dtype"), std::string::npos) << qkv_create_error();
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

}  // namespace
}  // namespace questkv
