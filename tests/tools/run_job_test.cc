// The main job end to end, in-process, on small sizes.
#include "tools/cli/run_job.h"

#include "tools/cli/commands.h"

#include <gtest/gtest.h>

#include <map>

namespace questkv::cli {
namespace {

RunOptions Small() {
  RunOptions o;
  o.config.geometry.layers = 3;
  o.config.geometry.q_heads = 4;
  o.config.geometry.kv_heads = 2;
  o.config.geometry.head_dim = 32;
  o.config.geometry.page_size = 16;
  o.config.policy.token_budget = 256;
  o.config.policy.dense_layers = {0};
  o.config.max_pages = 3 * 2 * (2048 / 16 + 4);
  o.context_tokens = 2000;
  o.decode_steps = 6;
  o.batch = 2;
  o.recall_every = 3;
  o.progress = false;
  return o;
}

TEST(RunJob, ReportsEveryRequiredField) {
  auto r = RunJob(Small());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::string json = ReportJson(*r);
  for (const char* key : {"\"geometry\":{", "\"context_tokens\":2000", "\"decode_steps\":6", "\"token_budget\":256",
                          "\"bytes_moved\":{\"host_to_hbm\":0", "\"dense_offload_bytes\":", "\"recall\":{",
                          "\"page\":", "\"attention_mass\":", "\"step_latency_us\":{\"p50\":", "\"p99\":",
                          "\"output_digest\":\""})
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in " << json;
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  // 2 sequences x 2 sparse layers x 2 sampled steps (0, 3).
  EXPECT_EQ(r->diagnosed, 8);
  EXPECT_GT(r->page_recall, 0.0);
  EXPECT_LE(r->page_recall, 1.0);
  EXPECT_GT(r->attention_mass_recall, 0.0);
  EXPECT_LE(r->attention_mass_recall, 1.0 + 1e-9);
  // Sparse layers read fewer head-pages than dense would.
  EXPECT_LT(r->head_pages_selected, r->head_pages_total);
  // Dense offload: every page of every layer and sequence, each step.
  const Geometry& g = r->options.config.geometry;
  int64_t expect = 0;
  for (int64_t step = 0; step < 6; ++step)
    for (int64_t len : {2000, 1993}) expect += 3 * ((len + step + 1 + 15) / 16) * int64_t(g.page_bytes());
  EXPECT_EQ(r->dense_offload_bytes, expect);
}

// The report reaches `finished` once, the same as the one returned.
TEST(RunJob, HandsTheReportOverBeforeTheTeardown) {
  int calls = 0;
  std::string seen;
  auto r = RunJob(Small(), [&](const RunReport& report) {
    ++calls;
    seen = ReportJson(report);
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, ReportJson(*r));
}

TEST(RunJob, DigestDependsOnlyOnWhatIsComputed) {
  RunOptions a = Small();
  RunOptions b = Small();
  b.config.max_pages *= 3;                                    // other capacity
  b.config.hbm_bytes = std::size_t(a.config.max_pages) * a.config.geometry.page_bytes();
  b.recall_every = 0;                                          // no diagnostics
  auto ra = RunJob(a), rb = RunJob(b);
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_EQ(ra->output_digest, rb->output_digest);
  RunOptions c = Small();
  c.seed = 2;
  auto rc = RunJob(c);
  ASSERT_TRUE(rc.ok());
  EXPECT_NE(ra->output_digest, rc->output_digest);
  RunOptions d = Small();
  d.config.policy.token_budget = 512;
  auto rd = RunJob(d);
  ASSERT_TRUE(rd.ok());
  EXPECT_NE(ra->output_digest, rd->output_digest);
}

TEST(RunJob, TinyTiersSpillToDiskAndComputeTheSameUnderStrict) {
  RunOptions a = Small();
  RunOptions b = Small();
  const Geometry& g = b.config.geometry;
  // KV cache: 2 sequences x 3 layers x ~126 pages. hbm 5%, host 5%, rest on disk.
  const std::size_t kv_bytes = std::size_t(b.config.max_pages) * g.page_bytes();
  b.config.hbm_bytes = kv_bytes / 20;
  b.config.host_bytes = kv_bytes / 20;
  b.config.disk_dir = ::testing::TempDir();
  b.config.disk_bytes = 2 * kv_bytes;
  b.config.io_backend = IoBackendKind::kPread;
  auto ra = RunJob(a), rb = RunJob(b);
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();
  EXPECT_EQ(ra->output_digest, rb->output_digest);
  EXPECT_GT(rb->bytes_moved.host_to_hbm, 0);
  EXPECT_GT(rb->bytes_moved.disk_to_host, 0);
  EXPECT_GT(rb->bytes_moved_prefill.host_to_disk, 0);
  EXPECT_GT(rb->tiers.cold_stalls, 0);
  EXPECT_LE(rb->tiers.hbm_peak_bytes, rb->tiers.hbm_capacity_bytes);
  EXPECT_LE(rb->tiers.host_peak_bytes, rb->tiers.host_capacity_bytes);
  // The per-step records add up to the run's totals, step by step in order.
  ASSERT_EQ(rb->steps.size(), 6u);
  int64_t hits = 0, misses = 0, link = 0, cold = 0, stalls = 0, skipped = 0;
  for (std::size_t s = 0; s < rb->steps.size(); ++s) {
    const RunReport::StepRecord& rec = rb->steps[s];
    EXPECT_GT(rec.us, 0);
    EXPECT_EQ(rec.query, Workload::Create(b.config.geometry, {b.workload, b.seed, 2000, 6})->Target(int64_t(s)).kind);
    hits += rec.hits, misses += rec.misses, link += rec.host_link_bytes;
    cold += rec.cold_misses, stalls += rec.cold_stalls, skipped += rec.pages_skipped;
  }
  EXPECT_EQ(hits, rb->tiers.hbm_hits);
  EXPECT_EQ(misses, rb->tiers.hbm_misses);
  EXPECT_EQ(link, rb->bytes_moved.host_to_hbm + rb->bytes_moved.hbm_to_host);
  EXPECT_GT(misses, 0);
  // Strict: every cold miss a stall, in the step it happened.
  EXPECT_EQ(cold, rb->tiers.cold_misses);
  EXPECT_EQ(stalls, rb->tiers.cold_stalls);
  EXPECT_EQ(stalls, cold);
  EXPECT_EQ(skipped, 0);
  // The CPU backend's phases are timed on every step without changing how it runs.
  for (const RunReport::StepRecord& rec : rb->steps) {
    EXPECT_FALSE(rec.instrumented);
    EXPECT_EQ(rec.graphs_captured, 0);  // no CUDA graphs
  }
  EXPECT_EQ(rb->step_latency_instrumented_us.p50, 0);
  const std::string json = ReportJson(*rb);
  EXPECT_NE(json.find("\"per_step\":[{\"us\":"), std::string::npos) << json;
  EXPECT_NE(json.find("\"by_query\":[{\"query\":\"recent\""), std::string::npos) << json;
  // Deadline: runs to completion, skips instead of stalling.
  b.config.cold_miss = ColdMissPolicy::kDeadline;
  auto rc = RunJob(b);
  ASSERT_TRUE(rc.ok()) << rc.status().ToString();
  EXPECT_EQ(rc->tiers.cold_stalls, 0);
  EXPECT_GT(rc->tiers.pages_skipped, 0);
  int64_t skipped_steps = 0;
  for (const RunReport::StepRecord& rec : rc->steps) {
    EXPECT_EQ(rec.cold_stalls, 0);
    EXPECT_EQ(rec.pages_skipped, rec.cold_misses);  // deadline skips every cold miss
    skipped_steps += rec.pages_skipped;
  }
  EXPECT_EQ(skipped_steps, rc->tiers.pages_skipped);
  EXPECT_NE(ReportJson(*rc).find("\"pages_skipped\":"), std::string::npos);
  // What the skips cost where they happen: the same selections (and their
  // error against dense), but outputs off the exact attention over them,
  // which strict's outputs match to rounding.
  EXPECT_LT(rb->attended_rel_error, 1e-5);
  EXPECT_NEAR(rb->selection_rel_error, rb->output_rel_error, 1e-5);
  EXPECT_NEAR(rc->selection_rel_error, rb->selection_rel_error, 1e-9);
  EXPECT_GT(rc->attended_rel_error, 1e-2);
  // Call by call (steps 0 and 3, sparse layers 1 and 2): strict skips
  // nothing; deadline's skips sit in its steps' counts, and the calls that
  // skipped carry the attended error while the others match to rounding.
  ASSERT_EQ(rb->diagnosed_calls.size(), 4u);
  ASSERT_EQ(rc->diagnosed_calls.size(), 4u);
  for (const RunReport::DiagnosedCall& c : rb->diagnosed_calls) {
    EXPECT_EQ(c.head_pages_skipped, 0);
    EXPECT_LT(c.attended_rel_error, 1e-5);
  }
  double attended = 0, attended_skipping = 0;
  int skipping = 0;
  std::map<int64_t, int64_t> skipped_by_step;
  for (std::size_t i = 0; i < rc->diagnosed_calls.size(); ++i) {
    const RunReport::DiagnosedCall& c = rc->diagnosed_calls[i];
    const RunReport::DiagnosedCall& strict = rb->diagnosed_calls[i];
    EXPECT_EQ(c.step, strict.step);
    EXPECT_EQ(c.layer, strict.layer);
    EXPECT_EQ(c.head_pages_selected, strict.head_pages_selected);  // the same selections
    EXPECT_GT(c.head_pages_selected, 0);
    EXPECT_LE(c.head_pages_skipped, c.head_pages_selected);
    skipped_by_step[c.step] += c.head_pages_skipped;
    attended += c.attended_rel_error;
    if (c.head_pages_skipped > 0) {
      ++skipping;
      attended_skipping += c.attended_rel_error;
    } else {
      EXPECT_LT(c.attended_rel_error, 1e-5);
    }
  }
  for (const auto& [step, skipped] : skipped_by_step) EXPECT_LE(skipped, rc->steps[std::size_t(step)].pages_skipped);
  ASSERT_GT(skipping, 0);
  EXPECT_GT(attended_skipping / skipping, 1e-2);
  EXPECT_NEAR(attended / 4, rc->attended_rel_error, 1e-9);  // every call diagnoses both sequences
  EXPECT_NE(ReportJson(*rc).find("\"calls\":[{\"step\":0,\"layer\":1,"), std::string::npos);
  // Deadline with no skips allowed: every call with a cold miss waits, and
  // the run computes what strict does.
  b.config.deadline_skip_limit = 0;
  auto rd = RunJob(b);
  ASSERT_TRUE(rd.ok()) << rd.status().ToString();
  EXPECT_EQ(rd->output_digest, ra->output_digest);
  EXPECT_EQ(rd->tiers.pages_skipped, 0);
  EXPECT_GT(rd->tiers.deadline_waits, 0);
  EXPECT_GT(rd->tiers.cold_stalls, 0);
  EXPECT_NE(ReportJson(*rd).find("\"deadline_skip_limit\":0"), std::string::npos);
  EXPECT_NE(FormatReport(*rd).find("calls past the skip limit"), std::string::npos);
}

// Diagnosing a subset of layers: the samples are those layers' (step,
// sequence)s, and the two one-layer runs average to the all-layer run.
TEST(RunJob, RecallLayersDiagnoseOnlyThoseLayers) {
  RunOptions all = Small();
  auto ra = RunJob(all);
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  double page = 0, mass = 0, err = 0;
  for (int layer : {1, 2}) {
    RunOptions one = Small();
    one.recall_layers = {layer};
    auto r = RunJob(one);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->diagnosed, 4);  // 2 sequences x 2 sampled steps
    EXPECT_EQ(r->output_digest, ra->output_digest);
    EXPECT_NE(ReportJson(*r).find("\"layers\":[" + std::to_string(layer) + "]"), std::string::npos);
    page += r->page_recall / 2, mass += r->attention_mass_recall / 2, err += r->output_rel_error / 2;
  }
  EXPECT_EQ(ra->diagnosed, 8);
  EXPECT_NEAR(page, ra->page_recall, 1e-12);
  EXPECT_NEAR(mass, ra->attention_mass_recall, 1e-12);
  EXPECT_NEAR(err, ra->output_rel_error, 1e-12);
  // A dense layer has no selection to diagnose; a layer past the model is none.
  for (int bad : {0, 3, -1}) {
    RunOptions o = Small();
    o.recall_layers = {1, bad};
    auto r = RunJob(o);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad;
  }
}

TEST(RunJob, FullBudgetRecallsEverything) {
  RunOptions o = Small();
  o.config.policy.token_budget = 1 << 20;
  auto r = RunJob(o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->page_recall, 1.0);
  EXPECT_NEAR(r->attention_mass_recall, 1.0, 1e-9);
  EXPECT_LT(r->output_rel_error, 1e-5);
  EXPECT_EQ(r->head_pages_selected, r->head_pages_total);
}

// Adaptive budgets: every sparse ranking is counted, and with sink and local
// its pages make up the head-pages read.
TEST(RunJob, ReportsAdaptiveBudgets) {
  RunOptions o = Small();
  o.config.policy.dense_layers = {};
  o.config.policy.unread_bound_mass = 0.2;
  o.recall_every = 0;
  auto r = RunJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const RunReport::Adaptive& a = r->adaptive;
  EXPECT_EQ(a.rankings, 2 * 3 * 2 * 6);  // sequences x layers x KV heads x steps
  const int64_t fixed = o.config.policy.sink_pages + o.config.policy.local_pages;
  EXPECT_EQ(a.pages + a.rankings * fixed, r->head_pages_selected);
  const int64_t cap = o.config.policy.token_budget / o.config.geometry.page_size - fixed;
  EXPECT_GT(a.pages_max, 0);
  EXPECT_LE(a.pages_max, cap);
  EXPECT_LE(a.pages_p95, a.pages_max);
  EXPECT_LE(a.cap_hits, a.rankings);
  EXPECT_LE(double(a.pages) / double(a.rankings), double(a.pages_max));
  const std::string json = ReportJson(*r);
  EXPECT_NE(json.find("\"adaptive\":{\"rankings\":72,"), std::string::npos) << json;
}

TEST(RunJob, ReportsTheStepBreakdownAndDenseBeside) {
  auto r = RunJob(Small());
  ASSERT_TRUE(r.ok());
  const RunReport::Breakdown& b = r->step_breakdown_us;
  EXPECT_GT(b.select, 0);
  EXPECT_GT(b.attend, 0);
  EXPECT_GE(b.resolve, 0);
  // The phases are parts of the step (prefetch bookkeeping aside).
  EXPECT_LE(b.append + b.select + b.resolve + b.attend, 1.05 * r->step_latency_us.mean + 50);
  EXPECT_EQ(r->compared_layers, 4);  // 2 sampled steps x 2 sparse layers, one batched call each
  EXPECT_GT(r->compared_dense_us, 0);
  const std::string json = ReportJson(*r);
  EXPECT_NE(json.find("\"step_breakdown_us\":{\"append\":"), std::string::npos);
  EXPECT_NE(json.find("\"dense_comparison\":{"), std::string::npos);
}

TEST(RunCommand, PresetsAndBadPresets) {
  const char* bad[] = {"run", "--preset", "gpt-9"};
  EXPECT_EQ(RunMain(3, const_cast<char**>(bad)), 2);
  const char* ok[] = {"run", "--preset", "llama3-8b", "--layers", "3", "--context", "300", "--steps", "2",
                      "--recall-every", "0", "--no-progress", "--json"};
  testing::internal::CaptureStdout();
  EXPECT_EQ(RunMain(13, const_cast<char**>(ok)), 0);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("\"geometry\":{\"layers\":3,\"q_heads\":32,\"kv_heads\":8,\"head_dim\":128"), std::string::npos)
      << out;
}

TEST(RunCommand, DecodeApiNeedsTheCudaBackend) {
  const char* device_on_cpu[] = {"run", "--decode-api", "device", "--no-progress"};
  EXPECT_EQ(RunMain(4, const_cast<char**>(device_on_cpu)), 2);
  const char* bogus[] = {"run", "--backend", "cuda", "--decode-api", "pinned", "--no-progress"};
  EXPECT_EQ(RunMain(6, const_cast<char**>(bogus)), 2);
  const char* host[] = {"run", "--decode-api", "host", "--layers", "2", "--context", "300", "--steps", "2",
                        "--recall-every", "0", "--no-progress", "--json"};
  testing::internal::CaptureStdout();
  EXPECT_EQ(RunMain(13, const_cast<char**>(host)), 0);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("\"decode_api\":\"host\""), std::string::npos) << out;
}

// --summary-dtype e4m3: the report names it, recall stays close to the exact
// summaries' (the bounds only loosen), and an unknown dtype is a usage error.
TEST(RunCommand, E4m3SummariesRunAndReportThemselves) {
  const char* bad[] = {"run", "--summary-dtype", "int4", "--no-progress"};
  EXPECT_EQ(RunMain(4, const_cast<char**>(bad)), 2);
  const char* e4m3[] = {"run", "--summary-dtype", "e4m3", "--layers", "3", "--context", "600", "--steps", "2",
                        "--no-progress", "--json"};
  testing::internal::CaptureStdout();
  EXPECT_EQ(RunMain(11, const_cast<char**>(e4m3)), 0);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("\"summary_dtype\":\"e4m3\""), std::string::npos) << out;
  RunOptions exact = Small(), small = Small();
  small.config.geometry.summary_dtype = SummaryDType::kE4M3;
  auto re = RunJob(exact), r8 = RunJob(small);
  ASSERT_TRUE(re.ok() && r8.ok());
  EXPECT_EQ(r8->diagnosed, re->diagnosed);
  EXPECT_NEAR(r8->attention_mass_recall, re->attention_mass_recall, 0.02);
  EXPECT_GE(r8->page_recall, re->page_recall - 0.05);
}

TEST(RunJob, BadOptionsAreErrors) {
  RunOptions o = Small();
  o.batch = 0;
  EXPECT_EQ(RunJob(o).status().code(), Code::kInvalidArgument);
  o = Small();
  o.context_tokens = 0;
  EXPECT_EQ(RunJob(o).status().code(), Code::kInvalidArgument);
  o = Small();
  o.config.max_pages = 10;  // far too few pages for the context
  EXPECT_EQ(RunJob(o).status().code(), Code::kResourceExhausted);
  o = Small();
  o.config.policy.token_budget = 16;  // one page < sink + local
  EXPECT_EQ(RunJob(o).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace questkv::cli
