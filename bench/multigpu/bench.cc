// Multi-GPU Quest decode: the decode step of --layers layers (one
// GpuDecoder per layer and rank, each holding its share of that layer's K/V)
// for a batch at long contexts on 1 vs N GPUs, ranks on threads of this
// process, exchanges over NCCL (or the threaded InProcessGroup with
// --comm inprocess). With --layers 32 the ranks hold a whole Llama-3-8B's
// K/V: a context whose share does not fit in a GPU's memory is reported as
// "does not fit" (ResourceExhausted), and the larger contexts of the same
// scheme and GPU count are skipped, so the table shows the largest context
// that runs on each GPU count. The workloads, each at every --contexts and --gpus:
//   context  context parallel: pages split over ranks, global top-K by
//            exchanged candidates, partial states merged in rank order
//   head     head parallel: KV heads split over ranks, outputs gathered
// Default geometry: Llama-3-8B (32 query / 8 KV heads x 128), S = 16,
// budget 2048 tokens (sink 1, local 8 pages), batch 1, f16 K/V.
// Per configuration: --warmup steps, then --reps steps, each after a
// barrier; the step time is rank 0's wall clock of GpuDecoder::Decode over
// every layer (each layer ends with its outputs on the host of every rank; the
// same query for every layer), with the part spent
// in the Communicator's collectives (the exchange) and the device times of
// select and attend (CUDA events). Every run's outputs are checked against
// the first run at the same context (same data: K/V are a function of the
// seed and the position only). Writes JSON to --json and prints a table last.
//   usage: questkv_multigpu_bench [--contexts 32768,...] [--gpus 1,2] [--schemes context,head]
//          [--reps 20] [--warmup 3] [--batch 1] [--budget 2048] [--layers 1] [--comm nccl|inprocess]
//          [--layout contiguous|round-robin] [--json FILE] [--commit SHA] [--timeout-s 300]
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "parallel/gpu_decode.h"
#include "parallel/inprocess_group.h"
#include "parallel/rendezvous.h"
#ifdef QUESTKV_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif

namespace questkv {
namespace {

struct Args {
  std::vector<int64_t> contexts = {32768, 65536, 131072, 262144, 524288, 1048576};
  std::vector<int> gpus = {1, 2};
  std::vector<std::string> schemes = {"context", "head"};
  int reps = 20, warmup = 3, batch = 1, layers = 1;
  int64_t budget = 2048;
  int q_heads = 32, kv_heads = 8, head_dim = 128, page_size = 16, sink = 1, local = 8;
  std::string comm = "nccl", layout = "contiguous", json, commit, command;
  double timeout_s = 300;
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr, "questkv_multigpu_bench: %s (see the top of bench/multigpu/bench.cc)\n", why);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 0; i < argc; ++i) a.command += std::string(i ? " " : "") + argv[i];
#ifndef QUESTKV_HAVE_NCCL
  a.comm = "inprocess";
#endif
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) Usage(("no value for " + k).c_str());
    const std::string v = argv[++i];
    if (k == "--contexts") {
      a.contexts.clear();
      for (const std::string& x : Split(v)) a.contexts.push_back(std::stoll(x));
    } else if (k == "--gpus") {
      a.gpus.clear();
      for (const std::string& x : Split(v)) a.gpus.push_back(std::stoi(x));
    } else if (k == "--schemes") a.schemes = Split(v);
    else if (k == "--reps") a.reps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--batch") a.batch = std::stoi(v);
    else if (k == "--layers") a.layers = std::stoi(v);
    else if (k == "--budget") a.budget = std::stoll(v);
    else if (k == "--comm") a.comm = v;
    else if (k == "--layout") a.layout = v;
    else if (k == "--json") a.json = v;
    else if (k == "--commit") a.commit = v;
    else if (k == "--timeout-s") a.timeout_s = std::stod(v);
    else Usage(("unknown flag " + k).c_str());
  }
  if (a.reps < 1 || a.batch < 1 || a.layers < 1) Usage("--reps, --batch and --layers must be >= 1");
  if (a.comm != "nccl" && a.comm != "inprocess") Usage("--comm is nccl or inprocess");
#ifndef QUESTKV_HAVE_NCCL
  if (a.comm == "nccl") Usage("built without NCCL (-DQUESTKV_NCCL=ON); use --comm inprocess");
#endif
  return a;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(q * (v.size() - 1) + 0.5))];
}

// One (context, scheme, ranks) configuration's result.
struct Result1 {
  int64_t context = 0;
  std::string scheme;
  int ranks = 0;
  std::string error;  // empty: ran
  bool no_fit = false;  // error is the device memory's (ResourceExhausted) or a smaller context's
  double step_us_median = 0, step_us_p10 = 0, step_us_p90 = 0;
  double exchange_us_median = 0, exchange_share_median = 0;
  double select_gpu_us_median = 0, attend_gpu_us_median = 0;
  std::size_t resident_bytes_per_gpu = 0;
  double max_rel_err_vs_first = -1;  // -1: this is the first run at its context
  std::vector<float> o;              // rank 0's last outputs, [batch][Hq][D]
};

using RankFn = std::function<Status(Communicator&, HostRendezvous&)>;

// Runs body(comm, rendezvous) on one thread per rank and returns the ranks'
// statuses.
std::vector<Status> RunRanks(const Args& a, int ranks, const RankFn& body) {
  HostRendezvous ready(ranks);
  if (a.comm == "inprocess")
    return InProcessGroup::Create(ranks).value()->Run([&](Communicator& comm) { return body(comm, ready); });
  std::vector<Status> st(ranks);
#ifdef QUESTKV_HAVE_NCCL
  Result<NcclId> id = NcclCommunicator::NewId();
  if (!id.ok()) return std::vector<Status>(ranks, id.status());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      NcclOptions options;
      options.device = r;
      auto comm = NcclCommunicator::Create(*id, r, ranks, options);
      if (comm.ok()) {
        st[r] = body(**comm, ready);
      } else {
        st[r] = comm.status();
        ready.AllOk(false);  // the others do not wait for this rank at the meeting
      }
    });
  for (auto& t : threads) t.join();
#endif
  return st;
}

// Every rank's part of one configuration: a decoder per layer over its
// share, the random K/V (each layer its own seed), a meeting where every rank
// is ready, warm-up, timed steps.
Status RankBody(const Args& a, const Geometry& g, const SelectionPolicy& p, const GpuDecodeOptions& o,
                const std::vector<GpuSequence>& seqs, const std::vector<float>& q, Communicator& comm,
                HostRendezvous& ready, Result1* res) {
  std::vector<std::unique_ptr<GpuDecoder>> layers;
  Status st = Status::Ok();
  for (int l = 0; l < a.layers && st.ok(); ++l) {
    auto made = GpuDecoder::Create(g, p, o, comm.size(), comm.rank(), seqs);
    st = made.status();
    if (st.ok()) st = (*made)->FillRandom(0x5eed + l);
    if (st.ok()) layers.push_back(std::move(*made));
  }
  // A rank that could not start tells the others before any collective.
  if (!ready.AllOk(st.ok())) return st.ok() ? Status::FailedPrecondition("another rank could not start") : st;
  const float scale = 1.f / std::sqrt(float(g.head_dim));
  std::vector<ParallelDecodeOutput> out;
  std::vector<double> step, exch, share, sel, att;
  for (int i = 0; i < a.warmup + a.reps; ++i) {
    QKV_RETURN_IF_ERROR(comm.Barrier());
    GpuStepTimes t;
    for (const std::unique_ptr<GpuDecoder>& dec : layers) {
      QKV_RETURN_IF_ERROR(dec->Decode(comm, q.data(), 0, scale, &out));
      const GpuStepTimes& lt = dec->last_times();
      t.total_us += lt.total_us;
      t.exchange_us += lt.exchange_us;
      t.select_gpu_us += lt.select_gpu_us;
      t.attend_gpu_us += lt.attend_gpu_us;
    }
    if (i < a.warmup) continue;
    step.push_back(t.total_us);
    exch.push_back(t.exchange_us);
    share.push_back(t.exchange_us / t.total_us);
    sel.push_back(t.select_gpu_us);
    att.push_back(t.attend_gpu_us);
  }
  if (comm.rank() != 0) return Status::Ok();
  res->step_us_median = Quantile(step, 0.5);
  res->step_us_p10 = Quantile(step, 0.1);
  res->step_us_p90 = Quantile(step, 0.9);
  res->exchange_us_median = Quantile(exch, 0.5);
  res->exchange_share_median = Quantile(share, 0.5);
  res->select_gpu_us_median = Quantile(sel, 0.5);
  res->attend_gpu_us_median = Quantile(att, 0.5);
  res->resident_bytes_per_gpu = 0;
  for (const std::unique_ptr<GpuDecoder>& dec : layers) res->resident_bytes_per_gpu += dec->resident_bytes();
  res->o.clear();
  for (const ParallelDecodeOutput& ob : out) res->o.insert(res->o.end(), ob.o.begin(), ob.o.end());
  return Status::Ok();
}

// Largest relative L2 error over query heads of o against ref.
double MaxRelErr(const std::vector<float>& o, const std::vector<float>& ref, int dim) {
  double worst = 0;
  for (std::size_t h = 0; h + dim <= ref.size() && h + dim <= o.size(); h += dim) {
    double num = 0, den = 0;
    for (int j = 0; j < dim; ++j) {
      num += double(o[h + j] - ref[h + j]) * (o[h + j] - ref[h + j]);
      den += double(ref[h + j]) * ref[h + j];
    }
    worst = std::max(worst, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
  }
  return o.size() == ref.size() ? worst : INFINITY;
}

std::string Json(const Args& a, const std::vector<Result1>& results) {
  int devices = 0;
  cudaGetDeviceCount(&devices);
  std::string names;
  for (int d = 0; d < devices; ++d) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, d);
    names += std::string(d ? "\", \"" : "") + prop.name;
  }
  char buf[1024];
  std::string s = "{\n  \"bench\": \"questkv_multigpu_bench\",\n";
  s += "  \"command\": \"" + a.command + "\",\n  \"commit\": \"" + a.commit + "\",\n";
  s += "  \"machine\": {\"gpus\": [\"" + names + "\"], \"gpu_count\": " + std::to_string(devices) + "},\n";
  std::snprintf(buf, sizeof buf,
                "  \"geometry\": {\"q_heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"page_size\": %d, "
                "\"layers\": %d, \"dtype\": \"f16\"},\n  \"policy\": {\"token_budget\": %lld, \"sink_pages\": %d, \"local_pages\": %d, "
                "\"gqa\": \"max\"},\n  \"batch\": %d, \"comm\": \"%s\", \"layout\": \"%s\", \"reps\": %d, "
                "\"warmup\": %d,\n  \"results\": [\n",
                a.q_heads, a.kv_heads, a.head_dim, a.page_size, a.layers, (long long)a.budget, a.sink, a.local, a.batch,
                a.comm.c_str(), a.layout.c_str(), a.reps, a.warmup);
  s += buf;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const Result1& r = results[i];
    std::snprintf(buf, sizeof buf,
                  "    {\"context_tokens\": %lld, \"scheme\": \"%s\", \"gpus\": %d, \"error\": \"%s\", "
                  "\"fits\": %s, "
                  "\"step_us_median\": %.2f, \"step_us_p10\": %.2f, \"step_us_p90\": %.2f, "
                  "\"exchange_us_median\": %.2f, \"exchange_share_median\": %.4f, \"select_gpu_us_median\": %.2f, "
                  "\"attend_gpu_us_median\": %.2f, \"resident_bytes_per_gpu\": %zu, \"max_rel_err_vs_first\": %.3g}%s\n",
                  (long long)r.context, r.scheme.c_str(), r.ranks, r.error.c_str(), r.no_fit ? "false" : "true",
                  r.step_us_median,
                  r.step_us_p10, r.step_us_p90, r.exchange_us_median, r.exchange_share_median,
                  r.select_gpu_us_median, r.attend_gpu_us_median, r.resident_bytes_per_gpu, r.max_rel_err_vs_first,
                  i + 1 < results.size() ? "," : "");
    s += buf;
  }
  return s + "  ]\n}\n";
}

void PrintTable(const std::vector<Result1>& results) {
  std::printf("\n%9s %-8s %4s %10s %10s %9s %7s %11s %11s %9s %9s\n", "context", "scheme", "gpus", "step_us",
              "p90_us", "exch_us", "exch%", "select_gpu", "attend_gpu", "MiB/gpu", "rel_err");
  for (const Result1& r : results) {
    if (!r.error.empty()) {
      std::printf("%9lld %-8s %4d  %s: %s\n", (long long)r.context, r.scheme.c_str(), r.ranks,
                  r.no_fit ? "does not fit" : "failed", r.error.c_str());
      continue;
    }
    std::printf("%9lld %-8s %4d %10.1f %10.1f %9.1f %6.1f%% %11.1f %11.1f %9.0f %9.2g\n", (long long)r.context,
                r.scheme.c_str(), r.ranks, r.step_us_median, r.step_us_p90, r.exchange_us_median,
                100 * r.exchange_share_median, r.select_gpu_us_median, r.attend_gpu_us_median,
                r.resident_bytes_per_gpu / 1048576.0, r.max_rel_err_vs_first);
  }
}

std::string JsonSafe(std::string s) {
  for (char& c : s)
    if (c == '"' || c == '\\' || c == '\n') c = '\'';
  return s;
}

int Main(int argc, char** argv) {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast stays off (KINDS.md)
  // Before the first CUDA call: every kernel loaded when a device's context
  // starts. Lazy loading (the default) loads a kernel at its first launch,
  // which can wait on the device while a peer rank's NCCL kernel waits for
  // this rank: a known way for threads-per-GPU NCCL programs to hang.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  Args a = Parse(argc, argv);
  a.command = JsonSafe(a.command);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    std::fprintf(stderr, "questkv_multigpu_bench: no CUDA device\n");
    return 1;
  }
  Geometry g;
  g.layers = 1;  // each decoder holds one layer; --layers decoders per rank
  g.q_heads = a.q_heads;
  g.kv_heads = a.kv_heads;
  g.head_dim = a.head_dim;
  g.page_size = a.page_size;
  g.dtype = DType::kF16;
  SelectionPolicy p;
  p.token_budget = a.budget;
  p.sink_pages = a.sink;
  p.local_pages = a.local;
  p.gqa = GqaMode::kMax;
  p.dense_layers = {};
  // A watchdog: a rank lost inside NCCL would hang the others.
  // Static: the detached thread reads it until the process exits, past Main.
  static std::atomic<int64_t> deadline_ms{0};
  std::thread([] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const int64_t d = deadline_ms.load();
      const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::steady_clock::now().time_since_epoch()).count();
      if (d > 0 && now > d) {
        std::fprintf(stderr, "questkv_multigpu_bench: a configuration ran past --timeout-s; exiting\n");
        std::fflush(nullptr);
        std::_Exit(3);
      }
    }
  }).detach();
  std::vector<Result1> results;
  std::vector<std::pair<std::string, int>> full;  // (scheme, GPUs) that ran out of device memory
  for (int64_t context : a.contexts) {
    const int pages = int((context + g.page_size - 1) / g.page_size);
    const int tail = int(context - int64_t(pages - 1) * g.page_size);
    const std::vector<GpuSequence> seqs(a.batch, GpuSequence{pages, tail});
    std::vector<float> q(std::size_t(a.batch) * g.q_heads * g.head_dim);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (float& v : q) {  // uniform(-1, 1) from a 64-bit LCG
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      v = float(x >> 40) / float(1 << 23) - 1.f;
    }
    const std::size_t first = results.size();
    for (const std::string& scheme : a.schemes)
      for (int ranks : a.gpus) {
        Result1 res;
        res.context = context;
        res.scheme = scheme;
        res.ranks = ranks;
        GpuDecodeOptions o;
        o.mode = scheme == "head" ? GpuParallelMode::kHead : GpuParallelMode::kContext;
        o.layout = a.layout == "round-robin" ? ShardLayout::kRoundRobin : ShardLayout::kContiguous;
        o.selection_to_host = false;
        const bool ran_out = std::find(full.begin(), full.end(), std::make_pair(scheme, ranks)) != full.end();
        if (a.comm == "nccl" && ranks > devices) {
          res.error = "needs " + std::to_string(ranks) + " GPUs, this machine has " + std::to_string(devices);
        } else if (ran_out) {
          res.error = "skipped: a smaller context did not fit";
          res.no_fit = true;
        } else {
          deadline_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count() +
                        int64_t(a.timeout_s * 1000);
          const std::vector<Status> st =
              RunRanks(a, ranks, [&](Communicator& comm, HostRendezvous& ready) {
                return RankBody(a, g, p, o, seqs, q, comm, ready, &res);
              });
          deadline_ms = 0;
          // A rank's own failure rather than another's "could not start".
          auto failed = std::find_if(st.begin(), st.end(), [](const Status& x) {
            return !x.ok() && x.code() != Code::kFailedPrecondition;
          });
          if (failed == st.end()) failed = std::find_if(st.begin(), st.end(), [](const Status& x) { return !x.ok(); });
          if (failed != st.end()) {
            res.error = JsonSafe(failed->ToString());
            res.no_fit = failed->code() == Code::kResourceExhausted;
          }
          if (res.no_fit) full.emplace_back(scheme, ranks);
        }
        if (res.error.empty()) {
          for (std::size_t i = first; i < results.size(); ++i)
            if (results[i].error.empty()) {
              res.max_rel_err_vs_first = MaxRelErr(res.o, results[i].o, g.head_dim);
              break;
            }
        }
        std::fprintf(stderr, "context %lld %s x%d: %s\n", (long long)context, scheme.c_str(), ranks,
                     res.error.empty() ? (std::to_string(res.step_us_median) + " us").c_str() : res.error.c_str());
        results.push_back(std::move(res));
      }
    for (std::size_t i = first; i < results.size(); ++i) results[i].o.clear();  // keep only the current context's
  }
  const std::string json = Json(a, results);
  if (!a.json.empty()) {
    if (FILE* f = std::fopen(a.json.c_str(), "w")) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    } else {
      std::fprintf(stderr, "questkv_multigpu_bench: cannot write %s\n", a.json.c_str());
    }
  }
  PrintTable(results);
  bool ok = true;
  for (const Result1& r : results) ok = ok && (r.error.empty() || r.no_fit || r.error.rfind("needs ", 0) == 0);
  for (const Result1& r : results) ok = ok && (!r.error.empty() || r.max_rel_err_vs_first < 2e-3);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace questkv

int main(int argc, char** argv) { return questkv::Main(argc, argv); }
