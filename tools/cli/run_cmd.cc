// questkv run: flag parsing and output for the main job (run_job.h).
#include <algorithm>
#include <cstdio>

#include "tools/cli/commands.h"
#include "tools/cli/flags.h"
#include "tools/cli/run_job.h"

namespace questkv::cli {

namespace {

constexpr const char* kUsage =
    "usage: questkv run [flags]   (defaults in brackets)\n"
    "backend:   --backend cpu|cuda [cpu] --dtype f32|f16|bf16 [f32 on cpu, f16 on cuda]\n"
    "           --summary-dtype kv|e4m3 [kv]: page summaries in the K/V dtype, or 8-bit codes rounded\n"
    "           outward (scores stay upper bounds; half of f16's bytes to scan on cuda)\n"
    "           cuda tuning (each switch measures the alternative with the same binary):\n"
    "           --no-cuda-graphs (launch every decode step directly instead of replaying graphs)\n"
    "           --no-chain-kernels (no programmatic dependent launch between a step's kernels)\n"
    "           --no-stage-misses (no HBM staging of misses while the resolve picks victims)\n"
    "           --gather-misses (the resolve's gather kernel fetches misses, not the attention)\n"
    "           --split-long-rows (long rows' top-K always in several launches)\n"
    "           --mma-scores (the select's scores on the tensor cores: last bits differ from the CPU's)\n"
    "           --profile-host (host time of each decode and append phase, and the stream's time\n"
    "           between the calls' marks, printed to stderr at the end)\n"
    "           --gen gpu|host [gpu on cuda]: where the prefill's K/V are generated (the same values)\n"
    "           --decode-api device|host [device on cuda]: decode calls on device pointers enqueued\n"
    "           back to back (as an engine), or host floats with each call waiting for its output\n"
    "geometry:  --layers 4 --q-heads 8 --kv-heads 2 --head-dim 64 --page-size 16\n"
    "           --preset llama2-7b (32 layers, 32 heads x 128) | llama3-8b (32 layers, 32 q / 8 KV heads x 128);\n"
    "           flags given beside a preset override it\n"
    "workload:  --workload structured|gaussian [structured] --seed 1 --context 32768\n"
    "           --steps 64 --batch 1 (sequence b holds context-7b tokens)\n"
    "policy:    --token-budget 1024 --sink-pages 1 --local-pages 8 --gqa max|mean|union [max]\n"
    "           --dense-layers L0,L1,... (or 'none') [0,1: the first two layers, fewer so that one\n"
    "           stays sparse (0 at --layers 2, none at --layers 1)]\n"
    "           --layer-budgets B0,B1,... (one a layer; -1 = --token-budget)\n"
    "           --rerank C [0: off] (the top C*K pages by the bound ranked again by their exact max\n"
    "           logit, the best K kept; on cuda a candidate on disk keeps its bound)\n"
    "           --group-pages B [0: the flat scan] (cpu: exact hierarchical scan, a box over each B\n"
    "           pages skips the groups that cannot reach the K-th score; the same selections)\n"
    "           --unread-bound-mass E [0: a fixed K] --adaptive-floor T [0] (adaptive budgets: the fewest\n"
    "           pages leaving at most E of the bound mass unread, T tokens to the budget; cuda: gqa max or\n"
    "           mean, no --rerank, budgets up to 2048 pages)\n"
    "memory:    --max-pages N [enough for the run] --hbm-bytes BYTES[K|M|G] [all pages]\n"
    "           --host-bytes BYTES [all pages] --disk-dir DIR [none] --disk-bytes BYTES\n"
    "           --io-backend auto|uring|uring-sqpoll|pread [auto] --io-queue-depth 64 --cold-miss strict|deadline\n"
    "           --io-checks-off-thread (a demotion's pre-write checksum check on the disk tier's own\n"
    "           thread, not the decoding one)\n"
    "           --deadline-skip-limit F [1] (deadline: a sequence's call whose cold misses pass F of\n"
    "           its selected head-pages at the layer waits for them)\n"
    "           --prefetch-pages 4 (runners-up promoted from disk ahead of need)\n"
    "report:    --recall-every 8 (0: no recall) --recall-layers L0,L1,... [every sparse layer]\n"
    "           --top-r 16 (at most the shortest sequence's tokens when first diagnosed:\n"
    "           --context - 7(batch-1) + 1; unset, it is clipped to that)\n"
    "           --json --no-progress\n"
    "metrics:   --metrics-port N (Prometheus text on 127.0.0.1:N/metrics; 0 = any free port)\n"
    "           --metrics-linger-ms MS (keep serving after the run; SIGTERM ends it early)\n"
    "speculative decoding, simulated: --draft N (a token and N drafts verified by one DecodeBlock call)\n"
    "           --accept-rate P [0.7] (each draft kept with probability P until the first rejection)\n"
    "           --block-selection per-position|shared [per-position] (a page set per draft, or one per\n"
    "           block: cpu)\n";

// The first min(2, layers - 1) layers: dense as in Quest, but one layer
// always stays sparse, so a small --layers still runs the selection.
std::vector<int64_t> DefaultDenseLayers(int layers) {
  std::vector<int64_t> dense;
  for (int l = 0; l < std::min(2, layers - 1); ++l) dense.push_back(l);
  return dense;
}

// The selection policy from its flags. What Config::Validate would refuse is
// refused here first, in the terms of the flags the user can change.
Status ParsePolicy(const Flags& f, const Geometry& g, SelectionPolicy& p) {
  QKV_ASSIGN_OR_RETURN(p.token_budget, f.Int("token-budget", p.token_budget, 0, int64_t(1) << 40));
  QKV_ASSIGN_OR_RETURN(int64_t sink, f.Int("sink-pages", p.sink_pages, 0, 1 << 20));
  QKV_ASSIGN_OR_RETURN(int64_t local, f.Int("local-pages", p.local_pages, 1, 1 << 20));
  p.sink_pages = int(sink), p.local_pages = int(local);
  QKV_ASSIGN_OR_RETURN(std::string gqa, f.String("gqa", "max"));
  QKV_ASSIGN_OR_RETURN(p.gqa, ParseGqaMode(gqa));
  QKV_ASSIGN_OR_RETURN(p.rerank, f.Double("rerank", p.rerank, 0, 1e6));
  QKV_ASSIGN_OR_RETURN(int64_t group_pages, f.Int("group-pages", p.group_pages, 0, 1 << 16));
  p.group_pages = int(group_pages);
  QKV_ASSIGN_OR_RETURN(p.unread_bound_mass, f.Double("unread-bound-mass", p.unread_bound_mass, 0, 1));
  QKV_ASSIGN_OR_RETURN(p.adaptive_floor, f.Int("adaptive-floor", p.adaptive_floor, 0, int64_t(1) << 40));
  QKV_ASSIGN_OR_RETURN(std::string block, f.String("block-selection", "per-position"));
  QKV_ASSIGN_OR_RETURN(p.block_selection, ParseBlockSelection(block));
  QKV_ASSIGN_OR_RETURN(std::vector<int64_t> dense, f.IntList("dense-layers", DefaultDenseLayers(g.layers)));
  p.dense_layers.clear();
  for (int64_t l : dense) {
    if (l < 0 || l >= g.layers)
      return Status::InvalidArgument("--dense-layers: " + std::to_string(l) + " is not a layer of --layers " +
                                     std::to_string(g.layers) + " (0.." + std::to_string(g.layers - 1) + ")");
    p.dense_layers.push_back(int(l));
  }
  QKV_ASSIGN_OR_RETURN(p.layer_token_budgets, f.IntList("layer-budgets", {}));
  if (!p.layer_token_budgets.empty() && p.layer_token_budgets.size() != std::size_t(g.layers))
    return Status::InvalidArgument("--layer-budgets has " + std::to_string(p.layer_token_budgets.size()) +
                                   " entries for --layers " + std::to_string(g.layers) + " (one a layer)");
  for (int layer = 0; layer < g.layers; ++layer) {
    if (p.is_dense(layer)) continue;
    const int64_t pages = p.page_budget(layer, g.page_size);
    if (pages >= int64_t(p.sink_pages) + p.local_pages) continue;
    const bool own = std::size_t(layer) < p.layer_token_budgets.size() && p.layer_token_budgets[layer] >= 0;
    const std::string budget = std::to_string(p.token_budget_for(layer));
    return Status::InvalidArgument(
        (own ? "--layer-budgets entry " + std::to_string(layer) + ", " + budget + " tokens,"
             : "--token-budget " + budget + " at layer " + std::to_string(layer)) +
        " is " + std::to_string(pages) + " pages of --page-size " + std::to_string(g.page_size) +
        ", fewer than --sink-pages " + std::to_string(p.sink_pages) + " + --local-pages " +
        std::to_string(p.local_pages) + " (raise the budget, lower those, or make the layer dense)");
  }
  return Status::Ok();
}

// What Config::Validate checks of the tier sizes, said in flags.
Status CheckSizes(const Config& c) {
  const std::string page = std::to_string(c.geometry.page_bytes()) + " bytes (" + c.geometry.ToString() + ")";
  if (c.hbm_bytes != 0 && c.hbm_bytes < c.geometry.page_bytes())
    return Status::InvalidArgument("--hbm-bytes " + std::to_string(c.hbm_bytes) + " holds no page; a page is " + page);
  if (c.host_bytes != 0 && c.host_bytes < 2 * c.geometry.page_bytes())
    return Status::InvalidArgument("--host-bytes " + std::to_string(c.host_bytes) +
                                   " holds fewer than two pages; a page is " + page);
  return Status::Ok();
}

Result<RunOptions> ParseRunOptions(const Flags& f) {
  RunOptions o;
  Geometry& g = o.config.geometry;
  QKV_ASSIGN_OR_RETURN(std::string backend, f.String("backend", "cpu"));
  QKV_ASSIGN_OR_RETURN(o.config.backend, ParseBackend(backend));
  QKV_ASSIGN_OR_RETURN(std::string dtype, f.String("dtype", o.config.backend == Backend::kCuda ? "f16" : "f32"));
  QKV_ASSIGN_OR_RETURN(g.dtype, ParseDType(dtype));
  QKV_ASSIGN_OR_RETURN(std::string summary_dtype, f.String("summary-dtype", "kv"));
  QKV_ASSIGN_OR_RETURN(g.summary_dtype, ParseSummaryDType(summary_dtype));
  o.config.cuda_graphs = !f.has("no-cuda-graphs");
  o.config.io_checks_off_thread = f.has("io-checks-off-thread");
  o.config.cuda_chain_kernels = !f.has("no-chain-kernels");
  o.config.cuda_stage_misses = !f.has("no-stage-misses");
  o.config.cuda_fill_in_attention = !f.has("gather-misses");
  o.config.cuda_split_long_rows = f.has("split-long-rows");
  o.config.cuda_mma_scores = f.has("mma-scores");
  o.config.cuda_profile_host = f.has("profile-host");
  QKV_ASSIGN_OR_RETURN(std::string gen, f.String("gen", o.config.backend == Backend::kCuda ? "gpu" : "host"));
  if (gen != "gpu" && gen != "host") return Status::InvalidArgument("--gen: '" + gen + "' (gpu, host)");
  if (gen == "gpu" && o.config.backend != Backend::kCuda)
    return Status::InvalidArgument("--gen gpu needs --backend cuda");
  o.gpu_workload = gen == "gpu";
  QKV_ASSIGN_OR_RETURN(std::string api, f.String("decode-api", o.config.backend == Backend::kCuda ? "device" : "host"));
  if (api != "device" && api != "host") return Status::InvalidArgument("--decode-api: '" + api + "' (device, host)");
  if (api == "device" && o.config.backend != Backend::kCuda)
    return Status::InvalidArgument("--decode-api device needs --backend cuda");
  o.device_decode = api == "device";
  SelectionPolicy& p = o.config.policy;
  QKV_ASSIGN_OR_RETURN(std::string preset, f.String("preset", ""));
  if (preset == "llama2-7b") {
    g.layers = 32, g.q_heads = 32, g.kv_heads = 32, g.head_dim = 128;
  } else if (preset == "llama3-8b") {
    g.layers = 32, g.q_heads = 32, g.kv_heads = 8, g.head_dim = 128;
  } else if (!preset.empty()) {
    return Status::InvalidArgument("--preset: unknown '" + preset + "' (llama2-7b, llama3-8b)");
  }
  QKV_ASSIGN_OR_RETURN(int64_t layers, f.Int("layers", g.layers, 1, 1024));
  QKV_ASSIGN_OR_RETURN(int64_t hq, f.Int("q-heads", g.q_heads, 1, 4096));
  QKV_ASSIGN_OR_RETURN(int64_t hkv, f.Int("kv-heads", g.kv_heads, 1, 1024));
  QKV_ASSIGN_OR_RETURN(int64_t d, f.Int("head-dim", g.head_dim, 1, 512));
  QKV_ASSIGN_OR_RETURN(int64_t s, f.Int("page-size", g.page_size, 1, 1024));
  g.layers = int(layers), g.q_heads = int(hq), g.kv_heads = int(hkv), g.head_dim = int(d), g.page_size = int(s);
  if (g.q_heads % g.kv_heads != 0)
    return Status::InvalidArgument("--q-heads " + std::to_string(g.q_heads) + " is not a multiple of --kv-heads " +
                                   std::to_string(g.kv_heads));

  QKV_ASSIGN_OR_RETURN(std::string workload, f.String("workload", "structured"));
  QKV_ASSIGN_OR_RETURN(o.workload, ParseWorkloadKind(workload));
  QKV_ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 1, 0, INT64_MAX));
  o.seed = uint64_t(seed);
  QKV_ASSIGN_OR_RETURN(o.context_tokens, f.Int("context", o.context_tokens, 1, int64_t(1) << 31));
  QKV_ASSIGN_OR_RETURN(o.decode_steps, f.Int("steps", o.decode_steps, 0, int64_t(1) << 31));
  QKV_ASSIGN_OR_RETURN(int64_t batch, f.Int("batch", o.batch, 1, 4096));
  o.batch = int(batch);
  QKV_ASSIGN_OR_RETURN(int64_t draft, f.Int("draft", 0, 0, 64));
  o.draft = int(draft);
  QKV_ASSIGN_OR_RETURN(o.accept_rate, f.Double("accept-rate", o.accept_rate, 0, 1));
  if (f.has("accept-rate") && o.draft == 0) return Status::InvalidArgument("--accept-rate needs --draft");
  if (f.has("block-selection") && o.draft == 0) return Status::InvalidArgument("--block-selection needs --draft");

  QKV_RETURN_IF_ERROR(ParsePolicy(f, g, p));

  // Enough page ids for the whole run unless told otherwise.
  const int64_t pages_per_seq = (o.context_tokens + DecodeTokens(o) + g.page_size - 1) / g.page_size + 1;
  const int64_t need = pages_per_seq * g.layers * o.batch;
  QKV_ASSIGN_OR_RETURN(int64_t max_pages, f.Int("max-pages", std::min<int64_t>(need, 1 << 30), 1, 1 << 30));
  o.config.max_pages = uint32_t(max_pages);
  QKV_ASSIGN_OR_RETURN(uint64_t hbm, f.Bytes("hbm-bytes", 0));
  o.config.hbm_bytes = hbm;
  QKV_ASSIGN_OR_RETURN(uint64_t host, f.Bytes("host-bytes", 0));
  o.config.host_bytes = host;
  QKV_ASSIGN_OR_RETURN(o.config.disk_dir, f.String("disk-dir", ""));
  QKV_ASSIGN_OR_RETURN(o.config.disk_bytes, f.Bytes("disk-bytes", 0));
  if (!o.config.disk_dir.empty() && o.config.disk_bytes == 0)
    return Status::InvalidArgument("--disk-dir needs --disk-bytes");
  QKV_ASSIGN_OR_RETURN(std::string io, f.String("io-backend", "auto"));
  QKV_ASSIGN_OR_RETURN(o.config.io_backend, ParseIoBackendKind(io));
  QKV_ASSIGN_OR_RETURN(int64_t qd, f.Int("io-queue-depth", o.config.io_queue_depth, 1, 4096));
  o.config.io_queue_depth = int(qd);
  QKV_ASSIGN_OR_RETURN(int64_t prefetch, f.Int("prefetch-pages", o.config.prefetch_pages, 0, 4096));
  o.config.prefetch_pages = int(prefetch);
  QKV_ASSIGN_OR_RETURN(std::string cold, f.String("cold-miss", "strict"));
  QKV_ASSIGN_OR_RETURN(o.config.cold_miss, ParseColdMissPolicy(cold));
  QKV_ASSIGN_OR_RETURN(o.config.deadline_skip_limit,
                       f.Double("deadline-skip-limit", o.config.deadline_skip_limit, 0, 1));
  if (f.has("deadline-skip-limit") && o.config.cold_miss != ColdMissPolicy::kDeadline)
    return Status::InvalidArgument("--deadline-skip-limit needs --cold-miss deadline");

  QKV_ASSIGN_OR_RETURN(int64_t every, f.Int("recall-every", o.recall_every, 0, INT32_MAX));
  // Unset, R is at most the tokens of the shortest sequence when first diagnosed.
  const int64_t top_r_default = std::clamp<int64_t>(DiagnosedTokensMin(o), 1, o.top_r);
  QKV_ASSIGN_OR_RETURN(int64_t top_r, f.Int("top-r", top_r_default, 1, 1 << 20));
  o.recall_every = int(every), o.top_r = int(top_r);
  QKV_ASSIGN_OR_RETURN(std::vector<int64_t> recall_layers, f.IntList("recall-layers", {}));
  for (int64_t l : recall_layers) {
    if (l < 0 || l >= g.layers)  // dense layers are refused by RunJob
      return Status::InvalidArgument("--recall-layers: " + std::to_string(l) + " is not a layer");
    o.recall_layers.push_back(int(l));
  }
  o.progress = !f.has("no-progress");
  QKV_ASSIGN_OR_RETURN(int64_t port, f.Int("metrics-port", -1, -1, 65535));
  QKV_ASSIGN_OR_RETURN(int64_t linger, f.Int("metrics-linger-ms", 0, 0, 600000));
  o.metrics_port = int(port), o.metrics_linger_ms = int(linger);
  QKV_RETURN_IF_ERROR(CheckSizes(o.config));
  QKV_RETURN_IF_ERROR(o.config.Validate());
  QKV_RETURN_IF_ERROR(CheckRunOptions(o));
  return o;
}

}  // namespace

int RunMain(int argc, char** argv) {
  Flags flags({"backend", "dtype", "summary-dtype", "gen", "decode-api", "preset", "layers", "q-heads", "kv-heads", "head-dim", "page-size", "workload", "seed", "context", "steps",
               "batch", "token-budget", "sink-pages", "local-pages", "gqa", "dense-layers", "layer-budgets",
               "max-pages", "hbm-bytes", "host-bytes", "disk-dir", "disk-bytes", "io-backend", "io-queue-depth",
               "cold-miss", "deadline-skip-limit", "prefetch-pages", "recall-every", "recall-layers", "top-r", "metrics-port", "metrics-linger-ms",
               "draft", "accept-rate", "block-selection", "rerank", "group-pages", "unread-bound-mass", "adaptive-floor"},
              {"json", "no-progress", "no-cuda-graphs", "no-chain-kernels", "io-checks-off-thread", "no-stage-misses", "gather-misses",
               "split-long-rows", "mma-scores", "profile-host", "help"});
  if (Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "questkv run: %s\n%s", s.message().c_str(), kUsage);
    return 2;
  }
  if (flags.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto options = ParseRunOptions(flags);
  if (!options.ok()) {
    std::fprintf(stderr, "questkv run: %s\n", options.status().ToString().c_str());
    return 2;
  }
  // Printed before the runtime's teardown, which can take long at 1M tokens.
  auto report = RunJob(*options, [&](const RunReport& r) {
    if (flags.has("json")) {
      std::printf("%s\n", ReportJson(r).c_str());
    } else {
      std::fputs(FormatReport(r).c_str(), stdout);
    }
    std::fflush(stdout);
  });
  if (!report.ok()) {
    std::fprintf(stderr, "questkv run: %s\n", report.status().ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace questkv::cli
