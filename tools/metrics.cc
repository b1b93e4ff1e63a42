#include "tools/metrics.h"

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <cstdio>
#include <thread>

namespace questkv {

namespace asio = boost::asio;
using asio::ip::tcp;

// ---- registry ----------------------------------------------------------------

const std::vector<double>& MetricsRegistry::StepBucketsUs() {
  static const std::vector<double> kBuckets = {100,   250,   500,    1000,   2500,   5000,    10000,
                                               25000, 50000, 100000, 250000, 500000, 1000000, 5000000};
  return kBuckets;
}

MetricsRegistry::MetricsRegistry() : buckets_(StepBucketsUs().size() + 1, 0) {}

void MetricsRegistry::Publish(const TierStats& tiers) {
  std::lock_guard<std::mutex> lock(mu_);
  tiers_ = tiers;
}

void MetricsRegistry::ObserveStep(double latency_us) {
  const auto& b = StepBucketsUs();
  const std::size_t i = std::size_t(std::lower_bound(b.begin(), b.end(), latency_us) - b.begin());
  std::lock_guard<std::mutex> lock(mu_);
  ++buckets_[i];
  ++steps_;
  step_sum_us_ += latency_us;
}

namespace {
void Metric(std::string& out, const char* name, const char* type, const char* help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}
void Sample(std::string& out, const std::string& name_labels, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, " %.17g\n", v);
  out += name_labels + buf;
}
}  // namespace

std::string MetricsRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  const TierStats& t = tiers_;
  std::string o;
  Metric(o, "questkv_bytes_moved_total", "counter", "Bytes moved between tiers, per link.");
  Sample(o, "questkv_bytes_moved_total{link=\"host_to_hbm\"}", double(t.bytes_host_to_hbm));
  Sample(o, "questkv_bytes_moved_total{link=\"hbm_to_host\"}", double(t.bytes_hbm_to_host));
  Sample(o, "questkv_bytes_moved_total{link=\"host_to_disk\"}", double(t.bytes_host_to_disk));
  Sample(o, "questkv_bytes_moved_total{link=\"disk_to_host\"}", double(t.bytes_disk_to_host));
  Metric(o, "questkv_hbm_hits_total", "counter", "Selected head-pages found in the hbm cache.");
  Sample(o, "questkv_hbm_hits_total", double(t.hbm_hits));
  Metric(o, "questkv_hbm_misses_total", "counter", "Selected head-pages not in the hbm cache.");
  Sample(o, "questkv_hbm_misses_total", double(t.hbm_misses));
  Metric(o, "questkv_cold_misses_total", "counter", "Selected head-pages whose home was disk.");
  Sample(o, "questkv_cold_misses_total", double(t.cold_misses));
  Metric(o, "questkv_cold_stalls_total", "counter", "Cold misses a step waited for (strict).");
  Sample(o, "questkv_cold_stalls_total", double(t.cold_stalls));
  Metric(o, "questkv_pages_skipped_total", "counter", "Cold misses a step attended without (deadline).");
  Sample(o, "questkv_pages_skipped_total", double(t.pages_skipped));
  Metric(o, "questkv_deadline_waits_total", "counter",
         "Decode calls that waited for their cold misses past the deadline skip limit.");
  Sample(o, "questkv_deadline_waits_total", double(t.deadline_waits));
  Metric(o, "questkv_disk_errors_total", "counter", "Disk I/O errors and checksum mismatches.");
  Sample(o, "questkv_disk_errors_total{kind=\"io\"}", double(t.io_errors));
  Sample(o, "questkv_disk_errors_total{kind=\"corruption\"}", double(t.corruptions));
  Metric(o, "questkv_tier_used_bytes", "gauge", "Bytes in use per tier.");
  Sample(o, "questkv_tier_used_bytes{tier=\"hbm\"}", double(t.hbm_used_bytes));
  Sample(o, "questkv_tier_used_bytes{tier=\"host\"}", double(t.host_used_bytes));
  Sample(o, "questkv_tier_used_bytes{tier=\"disk\"}", double(t.disk_used_bytes));
  Metric(o, "questkv_tier_capacity_bytes", "gauge", "Byte budget per tier.");
  Sample(o, "questkv_tier_capacity_bytes{tier=\"hbm\"}", double(t.hbm_capacity_bytes));
  Sample(o, "questkv_tier_capacity_bytes{tier=\"host\"}", double(t.host_capacity_bytes));
  Sample(o, "questkv_tier_capacity_bytes{tier=\"disk\"}", double(t.disk_capacity_bytes));
  Metric(o, "questkv_step_latency_us", "histogram", "Decode step latency (all layers), microseconds.");
  uint64_t cumulative = 0;
  const auto& b = StepBucketsUs();
  for (std::size_t i = 0; i < b.size(); ++i) {
    cumulative += buckets_[i];
    char le[32];
    std::snprintf(le, sizeof le, "%g", b[i]);
    Sample(o, std::string("questkv_step_latency_us_bucket{le=\"") + le + "\"}", double(cumulative));
  }
  Sample(o, "questkv_step_latency_us_bucket{le=\"+Inf\"}", double(steps_));
  Sample(o, "questkv_step_latency_us_sum", step_sum_us_);
  Sample(o, "questkv_step_latency_us_count", double(steps_));
  return o;
}

// ---- server ------------------------------------------------------------------

namespace {

constexpr std::size_t kMaxRequestBytes = 8192;
constexpr int kMaxConnections = 16;
constexpr auto kRequestTimeout = std::chrono::seconds(2);

std::string Response(int code, const char* reason, const std::string& body, const char* type = "text/plain") {
  return "HTTP/1.1 " + std::to_string(code) + " " + reason + "\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
}

// The answer to one request head (everything up to the blank line).
std::string Answer(const std::string& head, const MetricsRegistry& registry) {
  const std::size_t eol = head.find("\r\n");
  const std::string line = head.substr(0, eol);
  const std::size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string::npos || sp2 == sp1 || line.compare(sp2 + 1, 5, "HTTP/") != 0)
    return Response(400, "Bad Request", "malformed request line\n");
  const std::string method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (method != "GET" && method != "HEAD") return Response(405, "Method Not Allowed", "only GET\n");
  const std::string path = target.substr(0, target.find('?'));
  if (path != "/metrics") return Response(404, "Not Found", "try /metrics\n");
  std::string r = Response(200, "OK", registry.Render(), "text/plain; version=0.0.4");
  if (method == "HEAD") r.resize(r.find("\r\n\r\n") + 4);
  return r;
}

}  // namespace

struct MetricsServer::Impl {
  const MetricsRegistry* registry;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;
  std::atomic<uint64_t> served{0};
  int open_connections = 0;  // io thread only

  void Accept() {
    acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;  // acceptor closed
      if (open_connections < kMaxConnections) Serve(std::make_shared<tcp::socket>(std::move(socket)));
      Accept();
    });
  }

  void Serve(std::shared_ptr<tcp::socket> socket) {
    ++open_connections;
    auto buf = std::make_shared<asio::streambuf>(kMaxRequestBytes);
    auto timer = std::make_shared<asio::steady_timer>(io, kRequestTimeout);
    timer->async_wait([socket](boost::system::error_code ec) {
      if (!ec) socket->close();  // too slow: drop it
    });
    asio::async_read_until(*socket, *buf, "\r\n\r\n",
                           [this, socket, buf, timer](boost::system::error_code ec, std::size_t n) {
                             timer->cancel();
                             std::string reply;
                             if (!ec) {
                               std::string head(asio::buffers_begin(buf->data()),
                                                asio::buffers_begin(buf->data()) + std::ptrdiff_t(n));
                               reply = Answer(head, *registry);
                             } else if (ec == asio::error::not_found) {  // streambuf full
                               reply = Response(431, "Request Header Fields Too Large", "request too large\n");
                             }
                             Reply(socket, std::move(reply));
                           });
  }

  void Reply(std::shared_ptr<tcp::socket> socket, std::string reply) {
    if (reply.empty()) {
      --open_connections;
      return;
    }
    auto data = std::make_shared<std::string>(std::move(reply));
    asio::async_write(*socket, asio::buffer(*data), [this, socket, data](boost::system::error_code, std::size_t) {
      ++served;
      boost::system::error_code ignored;
      socket->shutdown(tcp::socket::shutdown_both, ignored);
      --open_connections;
    });
  }
};

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(int port, const MetricsRegistry* registry) {
  if (port < 0 || port > 65535) return Status::InvalidArgument("metrics port " + std::to_string(port) + " is out of range");
  auto impl = std::make_unique<Impl>();
  impl->registry = registry;
  boost::system::error_code ec;
  const tcp::endpoint endpoint(asio::ip::make_address("127.0.0.1"), uint16_t(port));
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(kMaxConnections, ec);
  if (ec) return Status::IOError("metrics: cannot listen on 127.0.0.1:" + std::to_string(port) + ": " + ec.message());
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::~MetricsServer() {
  impl_->io.stop();
  impl_->thread.join();
}

int MetricsServer::port() const { return impl_->acceptor.local_endpoint().port(); }
uint64_t MetricsServer::requests_served() const { return impl_->served.load(); }

}  // namespace questkv
