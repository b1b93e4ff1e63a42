// Shared by the GpuDecoder suites: a batch of random sequences as the GPU
// holds them (K/V rounded to f16, summaries of the rounded keys), the
// single-rank CPU reference (Selector on the f32 queries, attention with the
// queries rounded to f16 as the GPU reads them), a run of every rank of a
// group, and the checks: selections equal to the Selector's, outputs within
// 2e-3 (relative L2 per query head) of the reference, the same bits on
// every rank.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/gpu_decode.h"
#include "parallel/inprocess_group.h"
#include "parallel/rendezvous.h"
#include "tests/kernels_cuda/cuda_test_util.h"
#include "tests/parallel/parallel_test_util.h"

namespace questkv::test {

struct GpuBatch {
  Geometry g;
  std::vector<Sequence> seqs;
  std::vector<GpuSequence> shapes;
  std::vector<float> q;    // [B][Hq][D]: what selection ranks with
  std::vector<float> q16;  // q rounded to f16: what attention reads
};

// lengths: (pages, tail_len) per sequence; patterns as MakeSequence's.
inline GpuBatch MakeGpuBatch(const Geometry& g, const std::vector<std::pair<int, int>>& lengths, uint64_t seed,
                             int patterns = 0) {
  GpuBatch batch;
  batch.g = g;
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    Sequence s = MakeSequence(g, lengths[b].first, lengths[b].second, seed + 1000 * b, patterns);
    for (int i = 0; i < s.num_pages; ++i) {
      s.pages[i] = kernels::cuda::test::RoundTo(s.pages[i], kernels::cuda::DType::kF16);
      s.page_ptrs[i] = s.pages[i].data();
      kernels::RebuildSummaryCpu(s.pages[i].data(), s.slab.data() + s.ids[i] * g.summary_elems(), g.kv_heads,
                                 g.page_size, g.head_dim, i == s.num_pages - 1 ? s.tail_len : g.page_size);
    }
    batch.q.insert(batch.q.end(), s.q.begin(), s.q.end());
    batch.shapes.push_back({s.num_pages, s.tail_len});
    batch.seqs.push_back(std::move(s));
  }
  batch.q16 = kernels::cuda::test::RoundTo(batch.q, kernels::cuda::DType::kF16);
  return batch;
}

inline std::vector<Reference> References(const GpuBatch& batch, const SelectionPolicy& p, int layer) {
  std::vector<Reference> refs;
  const std::size_t per_seq = std::size_t(batch.g.q_heads) * batch.g.head_dim;
  for (std::size_t b = 0; b < batch.seqs.size(); ++b)
    refs.push_back(SingleRank(batch.seqs[b], p, layer, batch.q16.data() + b * per_seq));
  return refs;
}

// One rank's part: its decoder, its share of every sequence, one step. With
// `ready`, the ranks meet there between set-up and the step, and a set-up
// failure on any rank ends every rank before its first collective.
inline Status DecodeOnRank(Communicator& comm, const GpuBatch& batch, const SelectionPolicy& p,
                           const GpuDecodeOptions& options, int layer, std::vector<ParallelDecodeOutput>* out,
                           HostRendezvous* ready = nullptr) {
  Result<std::unique_ptr<GpuDecoder>> made =
      GpuDecoder::Create(batch.g, p, options, comm.size(), comm.rank(), batch.shapes);
  Status st = made.status();
  for (std::size_t b = 0; st.ok() && b < batch.seqs.size(); ++b)
    st = (*made)->LoadSequence(int(b), batch.seqs[b].page_ptrs.data());
  if (ready != nullptr && !ready->AllOk(st.ok()))
    return st.ok() ? Status::FailedPrecondition("another rank failed its set-up") : st;
  QKV_RETURN_IF_ERROR(st);
  return (*made)->Decode(comm, batch.q.data(), layer, Scale(batch.g), out);
}

struct GpuRun {
  std::vector<Status> statuses;                          // [rank]
  std::vector<std::vector<ParallelDecodeOutput>> outs;   // [rank][sequence]
};

// Every rank on a thread of an InProcessGroup; rank r on GPU r % devices.
inline GpuRun RunInProcess(const GpuBatch& batch, const SelectionPolicy& p, const GpuDecodeOptions& options,
                           int ranks, int layer) {
  auto group = InProcessGroup::Create(ranks).value();
  GpuRun run;
  run.outs.resize(ranks);
  run.statuses = group->Run([&](Communicator& comm) {
    return DecodeOnRank(comm, batch, p, options, layer, &run.outs[comm.rank()]);
  });
  return run;
}

// Each rank's selection rows equal the reference's (context parallel: every
// KV head; head parallel: the rank's own), its outputs are rank 0's bits, and
// they are within 2e-3 of the reference per query head.
inline void ExpectMatches(const GpuBatch& batch, const std::vector<Reference>& refs, const GpuRun& run,
                          const std::string& what) {
  const Geometry& g = batch.g;
  for (std::size_t r = 0; r < run.outs.size(); ++r) {
    ASSERT_TRUE(run.statuses[r].ok()) << what << " rank " << r << ": " << run.statuses[r].ToString();
    ASSERT_EQ(run.outs[r].size(), refs.size()) << what;
    for (std::size_t b = 0; b < refs.size(); ++b) {
      const ParallelDecodeOutput& out = run.outs[r][b];
      const std::string where = what + " rank " + std::to_string(r) + " sequence " + std::to_string(b);
      const int rows = int(out.selection.indptr.size()) - 1;
      EXPECT_EQ(Rows(out.selection, 0, rows), Rows(refs[b].selection, out.first_kv_head, rows)) << where;
      ASSERT_EQ(out.o.size(), refs[b].o.size()) << where;
      ASSERT_EQ(out.lse.size(), refs[b].lse.size()) << where;
      EXPECT_EQ(std::memcmp(out.o.data(), run.outs[0][b].o.data(), out.o.size() * sizeof(float)), 0) << where;
      for (int h = 0; h < g.q_heads; ++h) {
        const float* got = out.o.data() + std::size_t(h) * g.head_dim;
        const float* want = refs[b].o.data() + std::size_t(h) * g.head_dim;
        EXPECT_LE(RelL2Error(got, want, g.head_dim), 2e-3) << where << " head " << h;
        EXPECT_NEAR(out.lse[h], refs[b].lse[h], 2e-3 * std::max(1.f, std::fabs(refs[b].lse[h])))
            << where << " head " << h;
      }
    }
  }
}

// The ragged batch the suites decode: one page, two (under a budget above
// the page count), a partial tail, a long sequence.
inline std::vector<std::pair<int, int>> OddLengths(int page_size) {
  return {{1, 3}, {2, page_size}, {37, 5}, {160, page_size}};
}

// A dense layer (0) and a sparse one (1), each run on `ranks` threaded ranks
// and checked against the reference.
inline void ExpectLayersMatch(const GpuBatch& batch, const SelectionPolicy& p, const GpuDecodeOptions& options,
                              int ranks) {
  for (int layer : {0, 1})
    ExpectMatches(batch, References(batch, p, layer), RunInProcess(batch, p, options, ranks, layer),
                  "layer " + std::to_string(layer));
}

}  // namespace questkv::test
