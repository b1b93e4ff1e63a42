// questkv attend: replays one decode query over K/V given as .npy files
// through the real Runtime (append every token, one DecodeAttention), so a
// user can check Quest's selection and output on their own model's tensors.
//
// Exit codes (commands.h): 0 done, 2 usage error (flags alone are wrong:
// missing, unknown, not an integer, out of range, a budget smaller than the
// sink + local pages, an output path naming an input or the other output),
// 1 data or runtime error (unreadable or malformed files, shapes that
// disagree, NaN/Inf, magnitudes whose sums overflow float32, inputs larger
// than the memory the process may use, the runtime refusing).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tools/cli/commands.h"
#include "tools/cli/flags.h"
#include "questkv/config.h"
#include "tools/npy.h"
#include "questkv/runtime.h"
#include "questkv/status.h"

namespace questkv::cli {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitData = 1;
constexpr int kExitUsage = 2;

// Bytes of token-major K (and again V) staged per Append call.
constexpr int64_t kAppendChunkBytes = int64_t(8) << 20;
// Sink and local page counts, and array dimensions, beyond this cannot be a
// real request (the runtime counts pages in int and caps them at 2^30).
constexpr int64_t kMaxCount = int64_t(1) << 30;

constexpr char kUsage[] =
    "usage: questkv attend --keys K.npy --values V.npy --query Q.npy\n"
    "                      --page-size S --token-budget B --output O.npy\n"
    "                      [--selected SEL.npy] [--sink-pages N] [--local-pages N]\n"
    "                      [--gqa max|mean|union] [--dense] [--summary-dtype kv|e4m3]\n"
    "\n"
    "Replays one decode query over K/V from .npy files through the questkv runtime\n"
    "(CPU backend, fp32) and writes the attention output and the selected pages.\n"
    "Inputs must be finite and small enough for float32 sums: per query head\n"
    "sum_j |q_j|*max_t |k_tj|, and per KV head T*max|v|, at most about 3.4e38.\n"
    "\n"
    "  --keys K.npy         keys   [Hkv, T, D], float32 or float16\n"
    "  --values V.npy       values [Hkv, T, D], float32 or float16\n"
    "  --query Q.npy        one decode step's queries [Hq, D], float32 or float16;\n"
    "                       Hq must be a multiple of Hkv\n"
    "  --page-size S        tokens per page, 1..1024\n"
    "  --token-budget B     tokens attended per KV head: floor(B/S) pages, sink and\n"
    "                       local pages counted inside; optional with --dense\n"
    "  --sink-pages N       first pages always attended (default 0)\n"
    "  --local-pages N      last pages always attended, >= 1 (default 1)\n"
    "  --gqa MODE           query-head aggregation per KV head: max (default), mean,\n"
    "                       or union of per-query-head top-K\n"
    "  --dense              attend every page\n"
    "  --summary-dtype T    page summaries exact (kv, default) or as 8-bit E4M3 codes,\n"
    "                       each min rounded down and max up (a bound past +-448 is\n"
    "                       infinite and its page scores +inf)\n"
    "  --output O.npy       float32 [Hq, D] output, softmax scale 1/sqrt(D)\n"
    "  --selected SEL.npy   int32 [Hkv, N] selected logical page indices per KV head,\n"
    "                       ascending, padded with -1 (a path other than the inputs'\n"
    "                       and --output's)\n"
    "  --help               this text\n"
    "\n"
    "Exit status: 0 success, 1 bad input data or runtime failure, 2 usage error.\n";

struct AttendArgs {
  std::string keys, values, query, output, selected;
  int64_t page_size = -1;
  int64_t token_budget = -1;
  int64_t sink_pages = 0;
  int64_t local_pages = 1;
  GqaMode gqa = GqaMode::kMax;
  SummaryDType summary_dtype = SummaryDType::kKv;
  bool dense = false;
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "questkv attend: %s\n", message.c_str());
  if (code == kExitUsage) std::fprintf(stderr, "run 'questkv attend --help' for usage\n");
  return code;
}

// Whether two paths name one file: the same text, the same file on disk, or
// the same place once "." and ".." and symbolic links are resolved (an output
// need not exist yet).
bool SamePath(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  if (a == b) return true;
  std::error_code ec1, ec2;
  if (fs::exists(a, ec1) && fs::exists(b, ec2)) return fs::equivalent(a, b, ec1) && !ec1;
  const fs::path ca = fs::weakly_canonical(a, ec1), cb = fs::weakly_canonical(b, ec2);
  return !ec1 && !ec2 && ca == cb;
}

// An output naming an input, or both outputs naming one file, would lose
// data silently: the second write replaces the first.
Status CheckOutputPaths(const AttendArgs& a) {
  const std::pair<const char*, const std::string*> outputs[] = {{"output", &a.output}, {"selected", &a.selected}};
  const std::pair<const char*, const std::string*> others[] = {
      {"keys", &a.keys}, {"values", &a.values}, {"query", &a.query}, {"output", &a.output}};
  for (const auto& [out_flag, out] : outputs) {
    if (out->empty()) continue;
    for (const auto& [flag, path] : others) {
      if (path == out || !SamePath(*out, *path)) continue;
      return Status::InvalidArgument("--" + std::string(out_flag) + " '" + *out + "' and --" + flag + " '" + *path +
                                     "' name the same file; give each output a path of its own");
    }
  }
  return Status::Ok();
}

// Flags alone decide a usage error: any failure here exits 2.
Result<AttendArgs> ParseArgs(int argc, char** argv) {
  Flags flags({"keys", "values", "query", "output", "selected", "page-size", "token-budget", "sink-pages",
               "local-pages", "gqa", "summary-dtype"},
              {"dense"});
  QKV_RETURN_IF_ERROR(flags.Parse(argc, argv));
  AttendArgs a;
  for (const char* name : {"keys", "values", "query", "output", "page-size"})
    if (!flags.has(name)) return Status::InvalidArgument("missing required flag --" + std::string(name));
  a.dense = flags.has("dense");
  if (!a.dense && !flags.has("token-budget"))
    return Status::InvalidArgument("missing required flag --token-budget (or --dense)");
  for (auto [name, path] : {std::pair{"keys", &a.keys}, {"values", &a.values}, {"query", &a.query},
                            {"output", &a.output}, {"selected", &a.selected}}) {
    QKV_ASSIGN_OR_RETURN(*path, flags.String(name, ""));
    if (path->empty() && flags.has(name)) return Status::InvalidArgument("--" + std::string(name) + ": empty path");
  }
  QKV_RETURN_IF_ERROR(CheckOutputPaths(a));
  QKV_ASSIGN_OR_RETURN(a.page_size, flags.Int("page-size", 0, 1, 1024));
  QKV_ASSIGN_OR_RETURN(a.token_budget, flags.Int("token-budget", -1, 0, std::numeric_limits<int64_t>::max()));
  QKV_ASSIGN_OR_RETURN(a.sink_pages, flags.Int("sink-pages", 0, 0, kMaxCount));
  QKV_ASSIGN_OR_RETURN(a.local_pages, flags.Int("local-pages", 1, 1, kMaxCount));
  QKV_ASSIGN_OR_RETURN(const std::string gqa, flags.String("gqa", "max"));
  Result<GqaMode> mode = ParseGqaMode(gqa);
  if (!mode.ok()) return Status::InvalidArgument("--gqa: " + mode.status().message());
  a.gqa = *mode;
  QKV_ASSIGN_OR_RETURN(const std::string summary, flags.String("summary-dtype", "kv"));
  Result<SummaryDType> sd = ParseSummaryDType(summary);
  if (!sd.ok()) return Status::InvalidArgument("--summary-dtype: " + sd.status().message());
  a.summary_dtype = *sd;
  if (!a.dense) {
    const int64_t pages = a.token_budget / a.page_size;
    if (pages < a.sink_pages + a.local_pages)
      return Status::InvalidArgument(
          "--token-budget " + std::to_string(a.token_budget) + " gives " + std::to_string(pages) + " pages of " +
          std::to_string(a.page_size) + " tokens, fewer than --sink-pages " + std::to_string(a.sink_pages) +
          " + --local-pages " + std::to_string(a.local_pages));
  }
  return a;
}

std::string IndexString(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> idx(shape.size());
  for (std::size_t i = shape.size(); i-- > 0;) {
    idx[i] = flat % shape[i];
    flat /= shape[i];
  }
  std::string s = "[";
  for (std::size_t i = 0; i < idx.size(); ++i) s += (i ? ", " : "") + std::to_string(idx[i]);
  return s + "]";
}

// A float array of the given rank whose every value is finite.
Result<NpyArray> LoadFloat(const std::string& path, const char* what, std::size_t rank, const char* dims) {
  QKV_ASSIGN_OR_RETURN(NpyArray a, ReadNpy(path));
  if (a.dtype == NpyDType::kI32)
    return Status::InvalidArgument(path + ": " + what + " must be float32 or float16, not " +
                                   std::string(NpyDTypeName(a.dtype)));
  if (a.shape.size() != rank)
    return Status::InvalidArgument(path + ": " + what + " must have shape " + dims + ", got " + a.ShapeString());
  for (std::size_t i = 0; i < a.shape.size(); ++i)
    if (a.shape[i] < 1 || a.shape[i] > kMaxCount)
      return Status::InvalidArgument(path + ": " + what + " shape " + a.ShapeString() + " " + dims +
                                     ": every dimension must be in 1.." + std::to_string(kMaxCount));
  const auto bad = std::find_if(a.f32.begin(), a.f32.end(), [](float x) { return !std::isfinite(x); });
  if (bad != a.f32.end())
    return Status::InvalidArgument(path + ": " + what + " element " + IndexString(a.shape, bad - a.f32.begin()) +
                                   " is " + (std::isnan(*bad) ? "NaN" : "infinite") + "; inputs must be finite");
  return a;
}

struct Inputs {
  NpyArray k, v, q;
  int hkv = 0, hq = 0, d = 0;
  int64_t tokens = 0;
};

Result<Inputs> LoadInputs(const AttendArgs& a) {
  Inputs in;
  QKV_ASSIGN_OR_RETURN(in.k, LoadFloat(a.keys, "keys", 3, "[Hkv, T, D]"));
  QKV_ASSIGN_OR_RETURN(in.v, LoadFloat(a.values, "values", 3, "[Hkv, T, D]"));
  QKV_ASSIGN_OR_RETURN(in.q, LoadFloat(a.query, "query", 2, "[Hq, D]"));
  if (in.k.shape != in.v.shape)
    return Status::InvalidArgument("keys " + in.k.ShapeString() + " and values " + in.v.ShapeString() +
                                   " must have the same shape [Hkv, T, D]");
  if (in.q.shape[1] != in.k.shape[2])
    return Status::InvalidArgument("query " + in.q.ShapeString() + " has head dim " + std::to_string(in.q.shape[1]) +
                                   ", keys " + in.k.ShapeString() + " have " + std::to_string(in.k.shape[2]));
  if (in.q.shape[0] % in.k.shape[0] != 0)
    return Status::InvalidArgument("query heads Hq = " + std::to_string(in.q.shape[0]) +
                                   " is not a multiple of KV heads Hkv = " + std::to_string(in.k.shape[0]));
  in.hkv = int(in.k.shape[0]);
  in.tokens = in.k.shape[1];
  in.d = int(in.k.shape[2]);
  in.hq = int(in.q.shape[0]);
  return in;
}

// Headroom below float32's maximum for the rounding of the runtime's sums.
constexpr double kFloatLimit = double(std::numeric_limits<float>::max()) * (1.0 - 1.0 / 1024);

std::string Sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", x);
  return buf;
}

// The runtime computes in float32, so finite inputs can still overflow it
// and end in NaN. Refused here before any work, naming the head: every
// partial sum of q·k (taken before the 1/sqrt(D) scale) is at most
// Σ_j |q_j|·max_t |k_tj|, and every partial sum of the softmax-weighted
// values (weights at most 1) at most T·max|v|.
Status CheckFloatRange(const Inputs& in) {
  const std::size_t d = std::size_t(in.d);
  std::vector<double> kmax(std::size_t(in.hkv) * d, 0.0), vmax(std::size_t(in.hkv), 0.0);
  for (std::size_t h = 0; h < std::size_t(in.hkv); ++h) {
    for (std::size_t t = 0; t < std::size_t(in.tokens); ++t) {
      const std::size_t row = (h * std::size_t(in.tokens) + t) * d;
      for (std::size_t j = 0; j < d; ++j) {
        kmax[h * d + j] = std::max(kmax[h * d + j], double(std::fabs(in.k.f32[row + j])));
        vmax[h] = std::max(vmax[h], double(std::fabs(in.v.f32[row + j])));
      }
    }
  }
  const int group = in.hq / in.hkv;
  for (int h = 0; h < in.hq; ++h) {
    double bound = 0;
    for (std::size_t j = 0; j < d; ++j)
      bound += std::fabs(double(in.q.f32[std::size_t(h) * d + j])) * kmax[std::size_t(h / group) * d + j];
    if (bound > kFloatLimit)
      return Status::InvalidArgument("logits overflow float32: |q|·|k| reaches " + Sci(bound) + " for query head " +
                                     std::to_string(h) + " (Σ_j |q_j|·max_t |k_tj|; float32 holds up to " +
                                     Sci(std::numeric_limits<float>::max()) + "); scale the queries or keys down");
  }
  for (int h = 0; h < in.hkv; ++h) {
    const double bound = double(in.tokens) * vmax[std::size_t(h)];
    if (bound > kFloatLimit)
      return Status::InvalidArgument("values overflow float32 in the attention sum: " + std::to_string(in.tokens) +
                                     " tokens × max |v| " + Sci(vmax[std::size_t(h)]) + " reach " + Sci(bound) +
                                     " for KV head " + std::to_string(h) + " (float32 holds up to " +
                                     Sci(std::numeric_limits<float>::max()) + "); scale the values down");
  }
  return Status::Ok();
}

Result<Config> MakeConfig(const AttendArgs& a, const Inputs& in) {
  Config c;
  c.geometry.layers = 1;
  c.geometry.q_heads = in.hq;
  c.geometry.kv_heads = in.hkv;
  c.geometry.head_dim = in.d;
  c.geometry.page_size = int(a.page_size);
  c.geometry.dtype = DType::kF32;
  c.geometry.summary_dtype = a.summary_dtype;
  c.policy.token_budget = a.token_budget < 0 ? 0 : a.token_budget;
  c.policy.sink_pages = int(a.sink_pages);
  c.policy.local_pages = int(a.local_pages);
  c.policy.gqa = a.gqa;
  c.policy.dense_layers = a.dense ? std::vector<int>{0} : std::vector<int>{};
  // One page beyond the sequence's own, as the runtime may hold a fresh tail.
  c.max_pages = uint32_t((in.tokens + a.page_size - 1) / a.page_size + 1);
  QKV_RETURN_IF_ERROR(c.Validate());
  return c;
}

// Appends every token, transposing [Hkv][T][D] to token-major [n][Hkv][D].
Status AppendAll(Runtime& rt, SeqId seq, const Inputs& in) {
  const std::size_t row = std::size_t(in.d);
  const int64_t token_bytes = int64_t(in.hkv) * in.d * int64_t(sizeof(float));
  const int64_t chunk = std::clamp<int64_t>(kAppendChunkBytes / token_bytes, 1, in.tokens);
  std::vector<float> kbuf(std::size_t(chunk) * in.hkv * row), vbuf(kbuf.size());
  for (int64_t t0 = 0; t0 < in.tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, in.tokens - t0);
    for (int64_t t = 0; t < n; ++t) {
      for (int h = 0; h < in.hkv; ++h) {
        const std::size_t src = (std::size_t(h) * in.tokens + std::size_t(t0 + t)) * row;
        const std::size_t dst = (std::size_t(t) * in.hkv + h) * row;
        std::copy_n(in.k.f32.data() + src, row, kbuf.data() + dst);
        std::copy_n(in.v.f32.data() + src, row, vbuf.data() + dst);
      }
    }
    QKV_RETURN_IF_ERROR(rt.Append(seq, 0, kbuf.data(), vbuf.data(), n));
  }
  return Status::Ok();
}

// The selection as SEL [Hkv, N], checking what the runtime promised.
Result<std::vector<int32_t>> SelectionMatrix(const PageSelection& sel, int hkv, int64_t num_pages, int64_t* width) {
  if (sel.indptr.size() != std::size_t(hkv) + 1 || sel.indptr[0] != 0 ||
      sel.indptr.back() != int32_t(sel.pages.size()))
    return Status::Internal("runtime returned a selection with a malformed indptr");
  int64_t n = 0;
  for (int h = 0; h < hkv; ++h) {
    if (sel.count(h) < 0) return Status::Internal("runtime returned a selection with a decreasing indptr");
    n = std::max<int64_t>(n, sel.count(h));
  }
  std::vector<int32_t> m(std::size_t(hkv) * std::size_t(n), -1);
  for (int h = 0; h < hkv; ++h) {
    for (int i = 0; i < sel.count(h); ++i) {
      const int32_t p = sel.row(h)[i];
      if (p < 0 || p >= num_pages || (i > 0 && p <= sel.row(h)[i - 1]))
        return Status::Internal("runtime returned page " + std::to_string(p) + " for KV head " + std::to_string(h) +
                                " out of range or order (" + std::to_string(num_pages) + " pages)");
      m[std::size_t(h) * std::size_t(n) + std::size_t(i)] = p;
    }
  }
  *width = n;
  return m;
}

int Attend(const AttendArgs& a) {
  Result<Inputs> in = LoadInputs(a);
  if (!in.ok()) return Fail(kExitData, in.status().message());
  if (Status s = CheckFloatRange(*in); !s.ok()) return Fail(kExitData, s.message());
  Result<Config> config = MakeConfig(a, *in);
  if (!config.ok()) return Fail(kExitData, "inputs do not fit the runtime: " + config.status().message());
  Result<std::unique_ptr<Runtime>> rt = Runtime::Create(*config);
  if (!rt.ok()) return Fail(kExitData, "cannot create the runtime: " + rt.status().ToString());
  Result<SeqId> seq = (*rt)->CreateSequence();
  if (!seq.ok()) return Fail(kExitData, "cannot create a sequence: " + seq.status().ToString());
  if (Status s = AppendAll(**rt, *seq, *in); !s.ok()) return Fail(kExitData, "append failed: " + s.ToString());

  std::vector<float> out(std::size_t(in->hq) * std::size_t(in->d));
  std::vector<PageSelection> sels;
  const SeqId seqs[1] = {*seq};
  if (Status s = (*rt)->DecodeAttention(seqs, 0, in->q.f32.data(), out.data(), &sels); !s.ok())
    return Fail(kExitData, "decode attention failed: " + s.ToString());
  if (sels.size() != 1) return Fail(kExitData, "runtime returned " + std::to_string(sels.size()) + " selections for 1 sequence");
  const int64_t num_pages = (in->tokens + a.page_size - 1) / a.page_size;
  int64_t width = 0;
  Result<std::vector<int32_t>> sel = SelectionMatrix(sels[0], in->hkv, num_pages, &width);
  if (!sel.ok()) return Fail(kExitData, sel.status().ToString());

  const int64_t out_shape[2] = {in->hq, in->d};
  if (Status s = WriteNpyF32(a.output, out_shape, out); !s.ok()) return Fail(kExitData, s.message());
  if (!a.selected.empty()) {
    const int64_t sel_shape[2] = {in->hkv, width};
    if (Status s = WriteNpyI32(a.selected, sel_shape, *sel); !s.ok()) return Fail(kExitData, s.message());
  }
  std::printf("questkv attend: Hq %d Hkv %d D %d T %lld S %lld: %zu of %lld head-pages attended (%s); wrote %s%s%s\n",
              in->hq, in->hkv, in->d, static_cast<long long>(in->tokens), static_cast<long long>(a.page_size),
              sels[0].pages.size(), static_cast<long long>(num_pages * in->hkv),
              a.dense ? "dense" : std::string(GqaModeName(a.gqa)).c_str(), a.output.c_str(),
              a.selected.empty() ? "" : ", ", a.selected.c_str());
  return kExitOk;
}

}  // namespace

int AttendMain(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
  }
  Result<AttendArgs> args = ParseArgs(argc, argv);
  if (!args.ok()) return Fail(kExitUsage, args.status().message());
  return Attend(*args);
}

}  // namespace questkv::cli
