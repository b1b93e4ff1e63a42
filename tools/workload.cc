#include "tools/workload.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

namespace questkv {

namespace {

// ---- Counter-based random numbers --------------------------------------
// Every draw is Mix64(key + golden * (index + 1)): SplitMix64 evaluated at an
// arbitrary point of a stream, so no state is carried between calls.

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Draw(uint64_t key, uint64_t index) { return Mix64(key + kGolden * (index + 1)); }

// What a stream is for; its key also names the layer and head it belongs to.
enum class Stream : uint64_t {
  kKeyNoise = 1,
  kValueNoise,
  kQueryNoise,
  kDirection,  // per-head basis of special and topic directions
  kAnchor,     // per-topic drift anchors
  kLayout,     // spans and special runs (shared by all layers and heads)
  kQueryMix,   // per-query sink share and gain
  kSchedule,   // which older span a kTopic step aims at
};

uint64_t StreamKey(uint64_t seed, Stream stream, uint64_t a = 0, uint64_t b = 0) {
  uint64_t key = Draw(Mix64(seed), uint64_t(stream));
  key = Draw(key, a);
  return Draw(key, b);
}

// Uniform in [0, 1).
double Uniform(uint64_t key, uint64_t index) { return double(Draw(key, index) >> 11) * 0x1.0p-53; }

// n N(0,1) floats, Box-Muller over pairs: pair j comes from draw first_pair + j.
void FillNormal(uint64_t key, uint64_t first_pair, int n, float* out) {
  constexpr float kTwoPi = 2.0f * std::numbers::pi_v<float>;
  for (int i = 0; i < n; i += 2) {
    const uint64_t bits = Draw(key, first_pair + uint64_t(i / 2));
    const float u1 = float((bits >> 40) + 1) * 0x1.0p-24f;  // (0, 1]: log is finite
    const float u2 = float(bits & 0xFFFFFFu) * 0x1.0p-24f;
    const float radius = std::sqrt(-2.0f * std::log(u1));
    const float angle = kTwoPi * u2;
    out[i] = radius * std::cos(angle);
    if (i + 1 < n) out[i + 1] = radius * std::sin(angle);
  }
}

int PairsPerVector(int dim) { return (dim + 1) / 2; }

// ---- Structured workload parameters (bench/WORKLOADS.md) ----------------

constexpr int kTopics = 8;
constexpr int kNeedles = 4;
constexpr int64_t kSinkTokens = 4;
constexpr int64_t kNeedleTokens = 4;
constexpr int64_t kIntroTokens = 4;
constexpr int64_t kMentionTokens = 2;
constexpr int64_t kSpanTokensMin = 64;
constexpr int64_t kSpanTokensMax = 512;
// Topic centroids move to a fresh anchor every kDriftTokens; kDriftShare of a
// centroid's direction drifts, the rest is the topic's fixed direction.
constexpr int64_t kDriftTokens = 2048;
constexpr double kDriftShare = 0.6;
// Below max(kSpecialContextMin, kSpecialContextPages pages) the context has
// no room for needles and entities; above it their runs cannot overlap.
constexpr int64_t kSpecialContextMin = 1024;
constexpr int64_t kSpecialContextPages = 64;
// Key and value signal norms, in units of sqrt(D) (the norm of the noise).
constexpr float kKeySignal = 1.0f;
constexpr float kSinkKeySignal = 2.5f;
constexpr float kValueSignal = 1.0f;
// Sink values are near zero, so attending a sink is close to a no-op.
constexpr float kSinkValueScale = 0.25f;
// Cosine between the directions of entities A and B.
constexpr float kEntityCosine = 0.5f;
// Logit q.k/sqrt(D) of a key exactly on the query's target direction.
constexpr float kRecentLogit = 8.0f;
constexpr float kTopicLogit = 8.0f;
constexpr float kEntityLogit = 9.0f;
constexpr float kReversalLogit = 10.0f;
constexpr float kNeedleLogit = 10.0f;
// A query's component along the sink direction (its sink logit is
// kSinkKeySignal times it): uniform in [min, max] for kSinkQueryFraction of
// queries, in [-1, 0] for the rest.
constexpr double kSinkQueryFraction = 0.875;
constexpr float kSinkComponentMin = 3.5f;
constexpr float kSinkComponentMax = 5.0f;
constexpr float kQueryNoise = 0.3f;
constexpr float kHeadGainSpread = 0.15f;
// Recent queries skip a current span with fewer tokens than this.
constexpr int64_t kRecentSpanTokensMin = 16;
constexpr int64_t kCycleSteps = 16;

// Per-head directions: an orthonormal basis, then entity B (not orthogonal to A).
constexpr int kSinkDir = 0;
constexpr int kNeedleDir0 = 1;
constexpr int kEntityADir = kNeedleDir0 + kNeedles;
constexpr int kEntityBOrthDir = kEntityADir + 1;
constexpr int kTopicDir0 = kEntityBOrthDir + 1;
constexpr int kBasisDirs = kTopicDir0 + kTopics;
constexpr int kEntityBDir = kBasisDirs;
constexpr int kDirs = kBasisDirs + 1;
constexpr int kStructuredHeadDimMin = kBasisDirs + 1;

enum class Role : uint8_t { kTopic, kSink, kNeedle, kEntityA, kEntityB, kMention };

// A run of special tokens inside the context.
struct Run {
  int64_t begin;
  int64_t end;
  Role role;
  int needle;  // needle index for kNeedle
};

}  // namespace

struct WorkloadState {
  Geometry geometry;
  WorkloadSpec spec;
  // Structured only. Span i covers [span_begins[i], span_begins[i + 1]); the
  // last entry is total_tokens.
  std::vector<int64_t> span_begins;
  std::vector<int> span_topics;
  std::vector<Run> runs;  // sorted, disjoint
  // [layer][kv head][kDirs][D]: key directions, and value directions indexed alike.
  std::vector<float> key_dirs;
  std::vector<float> value_dirs;

  int dim() const { return geometry.head_dim; }
  int64_t total() const { return spec.context_tokens + spec.decode_steps; }
  bool structured() const { return spec.kind == WorkloadKind::kStructured; }
  bool has_specials() const {
    const int64_t min_tokens = std::max(kSpecialContextMin, kSpecialContextPages * geometry.page_size);
    return structured() && spec.context_tokens >= min_tokens;
  }

  const float* KeyDir(int layer, int head, int dir) const {
    return &key_dirs[((std::size_t(layer) * geometry.kv_heads + head) * kDirs + dir) * dim()];
  }
  const float* ValueDir(int layer, int head, int dir) const {
    return &value_dirs[((std::size_t(layer) * geometry.kv_heads + head) * kDirs + dir) * dim()];
  }
  std::size_t SpanOf(int64_t pos) const {
    return std::size_t(std::upper_bound(span_begins.begin(), span_begins.end(), pos) - span_begins.begin()) - 1;
  }
  const Run& RunAt(int64_t begin) const {
    const auto it = std::partition_point(runs.begin(), runs.end(), [&](const Run& r) { return r.begin < begin; });
    assert(it != runs.end() && it->begin == begin);
    return *it;
  }
  const Run* FindRun(Role role, int needle = 0) const {
    for (const Run& r : runs)
      if (r.role == role && (role != Role::kNeedle || r.needle == needle)) return &r;
    return nullptr;
  }
};

namespace {

using State = WorkloadState;

// ---- Vectors ------------------------------------------------------------

double Dot(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += double(a[i]) * b[i];
  return s;
}

void Normalize(float* x, int n) {
  const double norm = std::sqrt(Dot(x, x, n));
  const float inv = norm > 0 ? float(1.0 / norm) : 0.0f;
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

// x -= (x . b) b for the first `count` unit vectors of `basis` ([count][n]).
void ProjectOut(const float* basis, int count, int n, float* x) {
  for (int j = 0; j < count; ++j) {
    const float* b = basis + std::size_t(j) * n;
    const float c = float(Dot(x, b, n));
    for (int i = 0; i < n; ++i) x[i] -= c * b[i];
  }
}

void AddScaled(const float* x, float scale, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] += scale * x[i];
}

// ---- Layout: spans and special runs, shared by every layer and head -----

void BuildSpans(State& s) {
  const uint64_t key = StreamKey(s.spec.seed, Stream::kLayout, 0);
  int64_t pos = 0;
  int topic = -1;
  for (uint64_t i = 0; pos < s.total(); ++i) {
    s.span_begins.push_back(pos);
    const int64_t range = kSpanTokensMax - kSpanTokensMin + 1;
    pos += kSpanTokensMin + int64_t(Uniform(key, 2 * i) * double(range));
    // A new span always changes topic, so span boundaries are real boundaries.
    const double u = Uniform(key, 2 * i + 1);
    topic = i == 0 ? int(u * kTopics) : (topic + 1 + int(u * (kTopics - 1))) % kTopics;
    s.span_topics.push_back(topic);
  }
  s.span_begins.push_back(s.total());
}

// A run of `len` tokens starting `offset` tokens into the page holding `pos`.
Run PlaceRun(const State& s, double pos, int64_t offset, int64_t len, Role role, int needle = 0) {
  const int64_t page = s.geometry.page_size;
  int64_t begin = int64_t(pos) / page * page + offset;
  begin = std::clamp<int64_t>(begin, kSinkTokens, s.spec.context_tokens - len);
  return Run{begin, begin + len, role, needle};
}

// Needles land at the start, middle, end of a page and across a page boundary,
// so selection is checked where min/max boxes are cut (seed §2.2).
int64_t NeedleOffset(int needle, int64_t page) {
  const int64_t offsets[kNeedles] = {0, page / 2 - kNeedleTokens / 2, page - kNeedleTokens, page - kNeedleTokens / 2};
  return std::max<int64_t>(0, offsets[needle % kNeedles]);
}

bool Overlaps(const Run& a, const Run& b) { return a.begin < b.end && b.begin < a.end; }

void BuildRuns(State& s) {
  const uint64_t key = StreamKey(s.spec.seed, Stream::kLayout, 1);
  const double context = double(s.spec.context_tokens);
  const int64_t page = s.geometry.page_size;
  const auto page_offset = [&](uint64_t i, int64_t len) {
    return int64_t(Uniform(key, i) * double(std::max<int64_t>(1, page - len + 1)));
  };
  // Two similar entities early on; the page offsets vary with the seed.
  s.runs.push_back(PlaceRun(s, 0.05 * context, page_offset(0, kIntroTokens), kIntroTokens, Role::kEntityA));
  s.runs.push_back(PlaceRun(s, 0.09 * context, page_offset(1, kIntroTokens), kIntroTokens, Role::kEntityB));
  for (int n = 0; n < kNeedles; ++n) {
    const double pos = context * ((n + 1.0) / (kNeedles + 1) + 0.1 * (Uniform(key, 2 + n) - 0.5));
    s.runs.push_back(PlaceRun(s, pos, NeedleOffset(n, page), kNeedleTokens, Role::kNeedle, n));
  }
  const std::vector<Run> fixed = s.runs;
  // The middle of the context mentions A once in every span.
  for (std::size_t i = 0; i + 1 < s.span_begins.size(); ++i) {
    const int64_t begin = s.span_begins[i];
    if (begin < int64_t(0.3 * context) || begin >= int64_t(0.8 * context)) continue;
    const int64_t len = s.span_begins[i + 1] - begin;
    if (len < kMentionTokens) continue;
    const int64_t at = begin + int64_t(Uniform(key, 16 + i) * double(len - kMentionTokens));
    const Run mention{at, at + kMentionTokens, Role::kMention, 0};
    if (mention.end > s.spec.context_tokens) continue;
    if (std::none_of(fixed.begin(), fixed.end(), [&](const Run& r) { return Overlaps(r, mention); }))
      s.runs.push_back(mention);
  }
  std::sort(s.runs.begin(), s.runs.end(), [](const Run& a, const Run& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < s.runs.size(); ++i) assert(s.runs[i - 1].end <= s.runs[i].begin);
}

// ---- Directions ---------------------------------------------------------

// Orthonormal sink, needle, entity and topic directions for one head, then
// entity B = cos * A + sin * (A's orthogonal partner).
void BuildHeadDirs(const State& s, int layer, int head, float* dirs, float* value_dirs) {
  const int dim = s.dim();
  const uint64_t key = StreamKey(s.spec.seed, Stream::kDirection, uint64_t(layer), uint64_t(head));
  const uint64_t pairs = uint64_t(PairsPerVector(dim));
  for (int d = 0; d < kBasisDirs; ++d) {
    float* x = dirs + std::size_t(d) * dim;
    FillNormal(key, uint64_t(d) * pairs, dim, x);
    ProjectOut(dirs, d, dim, x);
    Normalize(x, dim);
  }
  const float sine = std::sqrt(1.0f - kEntityCosine * kEntityCosine);
  float* b = dirs + std::size_t(kEntityBDir) * dim;
  for (int i = 0; i < dim; ++i)
    b[i] = kEntityCosine * dirs[kEntityADir * dim + i] + sine * dirs[kEntityBOrthDir * dim + i];
  for (int d = 0; d < kDirs; ++d) {
    float* x = value_dirs + std::size_t(d) * dim;
    FillNormal(key, uint64_t(kDirs + d) * pairs, dim, x);
    Normalize(x, dim);
  }
}

void BuildDirs(State& s) {
  const std::size_t per_head = std::size_t(kDirs) * s.dim();
  const std::size_t heads = std::size_t(s.geometry.layers) * s.geometry.kv_heads;
  s.key_dirs.assign(heads * per_head, 0.0f);
  s.value_dirs.assign(heads * per_head, 0.0f);
  for (int layer = 0; layer < s.geometry.layers; ++layer)
    for (int head = 0; head < s.geometry.kv_heads; ++head) {
      const std::size_t at = (std::size_t(layer) * s.geometry.kv_heads + head) * per_head;
      BuildHeadDirs(s, layer, head, &s.key_dirs[at], &s.value_dirs[at]);
    }
}

// Unit anchor of a topic's centroid at knot `knot` (position knot * kDriftTokens):
// the topic's fixed direction plus a drift direction orthogonal to every
// special and topic direction, so drift never points at a needle or entity.
void Anchor(const State& s, int layer, int head, int topic, int64_t knot, float* out) {
  const int dim = s.dim();
  const uint64_t key = StreamKey(s.spec.seed, Stream::kAnchor, uint64_t(layer) * s.geometry.kv_heads + head,
                                 uint64_t(topic));
  FillNormal(key, uint64_t(knot) * PairsPerVector(dim), dim, out);
  const float* basis = s.KeyDir(layer, head, 0);
  ProjectOut(basis, kBasisDirs, dim, out);
  Normalize(out, dim);
  const float drift = float(std::sqrt(kDriftShare));
  const float fixed = float(std::sqrt(1.0 - kDriftShare));
  const float* topic_dir = s.KeyDir(layer, head, kTopicDir0 + topic);
  for (int i = 0; i < dim; ++i) out[i] = fixed * topic_dir[i] + drift * out[i];
}

// Topic centroids at successive positions of one head, reusing the two
// anchors around the position. The cache only saves work: a centroid is a
// function of (layer, head, topic, position) alone.
class CentroidCache {
 public:
  CentroidCache(const State& s, int layer, int head)
      : s_(s), layer_(layer), head_(head), lo_(s.dim()), hi_(s.dim()), out_(s.dim()) {}

  // Unit centroid of `topic` at `pos`: linear between the anchors of the
  // knots around pos, normalised.
  const float* Get(int topic, int64_t pos) {
    const int64_t knot = pos / kDriftTokens;
    Load(topic, knot);
    const float f = float(pos - knot * kDriftTokens) / float(kDriftTokens);
    for (int i = 0; i < s_.dim(); ++i) out_[i] = (1.0f - f) * lo_[i] + f * hi_[i];
    Normalize(out_.data(), s_.dim());
    return out_.data();
  }

 private:
  void Load(int topic, int64_t knot) {
    if (topic == topic_ && knot == knot_) return;
    if (topic == topic_ && knot == knot_ + 1) {
      lo_.swap(hi_);
    } else {
      Anchor(s_, layer_, head_, topic, knot, lo_.data());
    }
    Anchor(s_, layer_, head_, topic, knot + 1, hi_.data());
    topic_ = topic;
    knot_ = knot;
  }

  const State& s_;
  int layer_;
  int head_;
  int topic_ = -1;
  int64_t knot_ = -1;
  std::vector<float> lo_, hi_, out_;
};

// ---- Tokens -------------------------------------------------------------

// Walks positions in increasing order, naming each position's span and role.
class RoleCursor {
 public:
  RoleCursor(const State& s, int64_t begin)
      : s_(s), span_(s.SpanOf(begin)),
        run_(std::size_t(std::partition_point(s.runs.begin(), s.runs.end(),
                                              [&](const Run& r) { return r.end <= begin; }) -
                         s.runs.begin())) {}

  void Seek(int64_t pos) {
    while (s_.span_begins[span_ + 1] <= pos) ++span_;
    while (run_ < s_.runs.size() && s_.runs[run_].end <= pos) ++run_;
    pos_ = pos;
  }
  int topic() const { return s_.span_topics[span_]; }
  Role role() const {
    if (pos_ < kSinkTokens) return Role::kSink;
    if (run_ < s_.runs.size() && s_.runs[run_].begin <= pos_) return s_.runs[run_].role;
    return Role::kTopic;
  }
  int needle() const { return s_.runs[run_].needle; }

 private:
  const State& s_;
  std::size_t span_;
  std::size_t run_;
  int64_t pos_ = 0;
};

// The key and value direction index of a non-topic role.
int SpecialDir(Role role, int needle) {
  switch (role) {
    case Role::kSink: return kSinkDir;
    case Role::kNeedle: return kNeedleDir0 + needle;
    case Role::kEntityA:
    case Role::kMention: return kEntityADir;
    case Role::kEntityB: return kEntityBDir;
    case Role::kTopic: break;
  }
  assert(false && "topic tokens have no fixed direction");
  return 0;
}

// Adds the signal of the token at the cursor to its noise k and v.
void AddSignal(const State& s, int layer, int head, const RoleCursor& at, int64_t pos, CentroidCache& centroids,
               float* k, float* v) {
  const int dim = s.dim();
  const float unit = std::sqrt(float(dim));
  const Role role = at.role();
  if (role == Role::kTopic) {
    AddScaled(centroids.Get(at.topic(), pos), kKeySignal * unit, dim, k);
    AddScaled(s.ValueDir(layer, head, kTopicDir0 + at.topic()), kValueSignal * unit, dim, v);
    return;
  }
  if (role == Role::kSink) {
    AddScaled(s.KeyDir(layer, head, kSinkDir), kSinkKeySignal * unit, dim, k);
    for (int i = 0; i < dim; ++i) v[i] *= kSinkValueScale;
    return;
  }
  const int dir = SpecialDir(role, role == Role::kNeedle ? at.needle() : 0);
  AddScaled(s.KeyDir(layer, head, dir), kKeySignal * unit, dim, k);
  AddScaled(s.ValueDir(layer, head, dir), kValueSignal * unit, dim, v);
}

// ---- Queries ------------------------------------------------------------

float TargetLogit(QueryKind kind) {
  switch (kind) {
    case QueryKind::kRecent: return kRecentLogit;
    case QueryKind::kTopic: return kTopicLogit;
    case QueryKind::kEntity: return kEntityLogit;
    case QueryKind::kReversal: return kReversalLogit;
    case QueryKind::kNeedle: return kNeedleLogit;
    case QueryKind::kRandom: break;
  }
  return 0.0f;
}

// The span a kRecent query aims at: the current one, or the previous one
// while the current has barely started.
std::size_t RecentSpan(const State& s, int64_t pos) {
  std::size_t span = s.SpanOf(pos);
  if (span > 0 && pos - s.span_begins[span] < kRecentSpanTokensMin) --span;
  return span;
}

// An older span, at least kDriftTokens back so it is not the current topic
// seen again; none (returns false) in a short context.
bool OlderSpan(const State& s, int64_t step, int64_t pos, std::size_t* span) {
  const int64_t last_end = pos - kDriftTokens;
  if (last_end <= 0) return false;
  // Spans ending at or before last_end.
  const std::size_t count = s.SpanOf(last_end);
  if (count == 0) return false;
  const uint64_t key = StreamKey(s.spec.seed, Stream::kSchedule);
  *span = std::min(count - 1, std::size_t(Uniform(key, uint64_t(step)) * double(count)));
  return true;
}

// The span's tokens up to the query's own position, without the sink tokens
// unless nothing else is left.
QueryTarget SpanTarget(const State& s, QueryKind kind, std::size_t span, int64_t pos) {
  const int64_t end = std::min(s.span_begins[span + 1], pos + 1);
  int64_t begin = s.span_begins[span];
  if (end > kSinkTokens) begin = std::max(begin, kSinkTokens);
  return {kind, begin, end};
}

QueryTarget RunTarget(QueryKind kind, const Run* run) { return {kind, run->begin, run->end}; }

// Unit direction a query of this target aims at, for one KV head.
void TargetDir(const State& s, int layer, int head, const QueryTarget& t, int64_t pos, float* out) {
  const int dim = s.dim();
  int dir = 0;
  switch (t.kind) {
    case QueryKind::kRecent:
    case QueryKind::kTopic: {
      CentroidCache centroids(s, layer, head);
      const int topic = s.span_topics[s.SpanOf(t.begin)];
      const int64_t at = t.kind == QueryKind::kRecent ? pos : (t.begin + t.end) / 2;
      std::copy_n(centroids.Get(topic, at), dim, out);
      return;
    }
    case QueryKind::kEntity: dir = kEntityADir; break;
    case QueryKind::kReversal: dir = kEntityBDir; break;
    case QueryKind::kNeedle: dir = kNeedleDir0 + s.RunAt(t.begin).needle; break;
    case QueryKind::kRandom: std::fill_n(out, dim, 0.0f); return;
  }
  std::copy_n(s.KeyDir(layer, head, dir), dim, out);
}

// A query's component along the sink direction: positive for most queries,
// so sinks draw attention.
float SinkComponent(const State& s, int layer, int q_head, int64_t step) {
  const uint64_t key = StreamKey(s.spec.seed, Stream::kQueryMix, uint64_t(layer), uint64_t(q_head));
  const double pick = Uniform(key, 3 * uint64_t(step));
  const float u = float(Uniform(key, 3 * uint64_t(step) + 1));
  if (pick < kSinkQueryFraction) return kSinkComponentMin + (kSinkComponentMax - kSinkComponentMin) * u;
  return -u;
}

// Per-query gain around 1, so the heads of a group differ in sharpness.
float HeadGain(const State& s, int layer, int q_head, int64_t step) {
  const uint64_t key = StreamKey(s.spec.seed, Stream::kQueryMix, uint64_t(layer), uint64_t(q_head));
  return 1.0f + kHeadGainSpread * float(2.0 * Uniform(key, 3 * uint64_t(step) + 2) - 1.0);
}

}  // namespace

std::string_view WorkloadKindName(WorkloadKind kind) {
  switch (kind) {
    case WorkloadKind::kStructured: return "structured";
    case WorkloadKind::kGaussian: return "gaussian";
  }
  return "?";
}

Result<WorkloadKind> ParseWorkloadKind(std::string_view s) {
  if (s == "structured") return WorkloadKind::kStructured;
  if (s == "gaussian") return WorkloadKind::kGaussian;
  return Status::InvalidArgument("unknown workload '" + std::string(s) + "' (structured, gaussian)");
}

std::string_view QueryKindName(QueryKind kind) {
  switch (kind) {
    case QueryKind::kRecent: return "recent";
    case QueryKind::kTopic: return "topic";
    case QueryKind::kEntity: return "entity";
    case QueryKind::kReversal: return "reversal";
    case QueryKind::kNeedle: return "needle";
    case QueryKind::kRandom: return "random";
  }
  return "?";
}

Result<Workload> Workload::Create(const Geometry& geometry, const WorkloadSpec& spec) {
  QKV_RETURN_IF_ERROR(geometry.Validate());
  if (spec.context_tokens < 1)
    return Status::InvalidArgument("context_tokens = " + std::to_string(spec.context_tokens) + ": must be >= 1");
  if (spec.decode_steps < 0)
    return Status::InvalidArgument("decode_steps = " + std::to_string(spec.decode_steps) + ": must be >= 0");
  if (spec.context_tokens > kMaxTokens - spec.decode_steps)
    return Status::InvalidArgument("context_tokens + decode_steps must be <= " + std::to_string(kMaxTokens));
  if (spec.kind == WorkloadKind::kStructured && geometry.head_dim < kStructuredHeadDimMin)
    return Status::InvalidArgument("head_dim = " + std::to_string(geometry.head_dim) +
                                   ": the structured workload needs head_dim >= " +
                                   std::to_string(kStructuredHeadDimMin));
  auto state = std::make_shared<WorkloadState>();
  state->geometry = geometry;
  state->spec = spec;
  if (state->structured()) {
    BuildSpans(*state);
    if (state->has_specials()) BuildRuns(*state);
    BuildDirs(*state);
  }
  return Workload(std::move(state));
}

Workload::Workload(std::shared_ptr<const WorkloadState> state) : state_(std::move(state)) {}

const Geometry& Workload::geometry() const { return state_->geometry; }
const WorkloadSpec& Workload::spec() const { return state_->spec; }
int64_t Workload::total_tokens() const { return state_->total(); }
int64_t Workload::sink_tokens() const {
  return state_->structured() ? std::min(kSinkTokens, state_->total()) : 0;
}

void Workload::Tokens(int layer, int64_t begin, int64_t n, float* k, float* v) const {
  const WorkloadState& s = *state_;
  assert(layer >= 0 && layer < s.geometry.layers);
  assert(begin >= 0 && n >= 0 && begin + n <= s.total());
  if (n == 0) return;
  const int dim = s.dim();
  const int heads = s.geometry.kv_heads;
  const uint64_t pairs = uint64_t(PairsPerVector(dim));
  std::vector<uint64_t> k_keys(heads), v_keys(heads);
  std::vector<CentroidCache> centroids;
  for (int h = 0; h < heads; ++h) {
    k_keys[h] = StreamKey(s.spec.seed, Stream::kKeyNoise, uint64_t(layer), uint64_t(h));
    v_keys[h] = StreamKey(s.spec.seed, Stream::kValueNoise, uint64_t(layer), uint64_t(h));
    centroids.emplace_back(s, layer, h);
  }
  std::optional<RoleCursor> cursor;
  if (s.structured()) cursor.emplace(s, begin);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = begin + i;
    if (cursor) cursor->Seek(pos);
    for (int h = 0; h < heads; ++h) {
      float* kh = k + (std::size_t(i) * heads + h) * dim;
      float* vh = v + (std::size_t(i) * heads + h) * dim;
      FillNormal(k_keys[h], uint64_t(pos) * pairs, dim, kh);
      FillNormal(v_keys[h], uint64_t(pos) * pairs, dim, vh);
      if (cursor) AddSignal(s, layer, h, *cursor, pos, centroids[h], kh, vh);
    }
  }
}

WorkloadTokenTables Workload::TokenTables() const {
  const WorkloadState& s = *state_;
  WorkloadTokenTables t;
  t.structured = s.structured();
  const int heads = s.geometry.kv_heads;
  for (int layer = 0; layer < s.geometry.layers; ++layer)
    for (int h = 0; h < heads; ++h) {
      t.key_noise.push_back(StreamKey(s.spec.seed, Stream::kKeyNoise, uint64_t(layer), uint64_t(h)));
      t.value_noise.push_back(StreamKey(s.spec.seed, Stream::kValueNoise, uint64_t(layer), uint64_t(h)));
      if (!t.structured) continue;
      for (int topic = 0; topic < kTopics; ++topic)
        t.anchor_keys.push_back(StreamKey(s.spec.seed, Stream::kAnchor, uint64_t(layer) * heads + h, uint64_t(topic)));
    }
  if (!t.structured) return t;
  const float unit = std::sqrt(float(s.dim()));
  t.constants = {.topics = kTopics,
                 .dirs = kDirs,
                 .basis_dirs = kBasisDirs,
                 .sink_dir = kSinkDir,
                 .topic_dir0 = kTopicDir0,
                 .sink_tokens = kSinkTokens,
                 .drift_tokens = kDriftTokens,
                 // As AddSignal and Anchor compute them.
                 .key_scale = kKeySignal * unit,
                 .sink_key_scale = kSinkKeySignal * unit,
                 .value_scale = kValueSignal * unit,
                 .sink_value_scale = kSinkValueScale,
                 .anchor_fixed = float(std::sqrt(1.0 - kDriftShare)),
                 .anchor_drift = float(std::sqrt(kDriftShare))};
  t.span_begins = s.span_begins;
  t.span_topics = s.span_topics;
  for (const Run& r : s.runs)
    t.runs.push_back({r.begin, r.end, SpecialDir(r.role, r.role == Role::kNeedle ? r.needle : 0)});
  t.key_dirs = s.key_dirs;
  t.value_dirs = s.value_dirs;
  return t;
}

QueryTarget Workload::Target(int64_t step) const {
  const WorkloadState& s = *state_;
  assert(step >= 0 && step < s.spec.decode_steps);
  if (!s.structured()) return {};
  const int64_t pos = s.spec.context_tokens + step;
  const QueryTarget recent = SpanTarget(s, QueryKind::kRecent, RecentSpan(s, pos), pos);
  if (!s.has_specials()) return recent;
  const int64_t phase = step % kCycleSteps;
  const int64_t cycle = step / kCycleSteps;
  if (phase == 3 || phase == 9) {
    std::size_t span = 0;
    return OlderSpan(s, step, pos, &span) ? SpanTarget(s, QueryKind::kTopic, span, pos) : recent;
  }
  if (phase == 5 || phase == 11 || phase == 13) return RunTarget(QueryKind::kEntity, s.FindRun(Role::kEntityA));
  if (phase == kCycleSteps - 1) {
    if (cycle % 2 == 0) return RunTarget(QueryKind::kReversal, s.FindRun(Role::kEntityB));
    return RunTarget(QueryKind::kNeedle, s.FindRun(Role::kNeedle, int(cycle / 2 % kNeedles)));
  }
  return recent;
}

void Workload::Query(int layer, int64_t step, float* q) const {
  const WorkloadState& s = *state_;
  assert(layer >= 0 && layer < s.geometry.layers);
  assert(step >= 0 && step < s.spec.decode_steps);
  const int dim = s.dim();
  const int group = s.geometry.group();
  const int64_t pos = s.spec.context_tokens + step;
  const QueryTarget target = Target(step);
  std::vector<float> aim(dim);
  for (int h = 0; h < s.geometry.kv_heads; ++h) {
    if (s.structured()) TargetDir(s, layer, h, target, pos, aim.data());
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      float* out = q + std::size_t(qh) * dim;
      const uint64_t key = StreamKey(s.spec.seed, Stream::kQueryNoise, uint64_t(layer), uint64_t(qh));
      FillNormal(key, uint64_t(step) * PairsPerVector(dim), dim, out);
      if (!s.structured()) continue;
      for (int i = 0; i < dim; ++i) out[i] *= kQueryNoise;
      AddScaled(aim.data(), TargetLogit(target.kind) * HeadGain(s, layer, qh, step), dim, out);
      AddScaled(s.KeyDir(layer, h, kSinkDir), SinkComponent(s, layer, qh, step), dim, out);
    }
  }
}

}  // namespace questkv
