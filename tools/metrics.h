// Metrics: counters, gauges and a step-latency histogram, rendered in the
// Prometheus text format (version 0.0.4) and served over HTTP on loopback.
//
// MetricsRegistry is the one place the numbers are kept: the decode thread
// publishes a snapshot after each step; the server thread renders it. All
// methods are thread-safe (one mutex; publishing is a copy of a small struct).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "questkv/runtime.h"
#include "questkv/status.h"

namespace questkv {

class MetricsRegistry {
 public:
  MetricsRegistry();
  // The runtime's tier counters and occupancy as of now.
  void Publish(const TierStats& tiers);
  // One decode step's latency (all layers), in microseconds.
  void ObserveStep(double latency_us);
  // Prometheus text exposition of everything published so far.
  std::string Render() const;

  // Histogram bucket upper bounds, microseconds (+Inf implied).
  static const std::vector<double>& StepBucketsUs();

 private:
  mutable std::mutex mu_;
  TierStats tiers_;
  std::vector<uint64_t> buckets_;  // cumulative at render time; raw counts here
  uint64_t steps_ = 0;
  double step_sum_us_ = 0;
};

// A minimal HTTP/1.1 server on 127.0.0.1 serving GET /metrics. Anything else
// gets an HTTP error (400 malformed, 404 unknown path, 405 other methods,
// 431 oversized request); each connection answers one request and closes.
// Requests are bounded in size and time; the server never takes more than a
// fixed number of connections at once.
class MetricsServer {
 public:
  // port 0 picks a free port (see port()). IOError when it cannot bind.
  static Result<std::unique_ptr<MetricsServer>> Start(int port, const MetricsRegistry* registry);
  ~MetricsServer();  // stops the server thread
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  int port() const;
  // Requests answered so far, errors included.
  uint64_t requests_served() const;

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace questkv
