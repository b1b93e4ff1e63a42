// MetricsRegistry rendering (Prometheus text) and the server's answers.
#include "tools/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace questkv {
namespace {

std::string Ask(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "connect failed";
  }
  (void)!write(fd, request.data(), request.size());
  std::string reply;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) reply.append(buf, std::size_t(n));
  close(fd);
  return reply;
}

TEST(Metrics, RendersCountersGaugesAndACumulativeHistogram) {
  MetricsRegistry m;
  TierStats t;
  t.bytes_host_to_hbm = 4096;
  t.hbm_hits = 7;
  t.disk_capacity_bytes = 1 << 20;
  m.Publish(t);
  m.ObserveStep(90);      // <= 100
  m.ObserveStep(3000);    // <= 5000
  m.ObserveStep(9e6);     // +Inf only
  const std::string text = m.Render();
  EXPECT_NE(text.find("questkv_bytes_moved_total{link=\"host_to_hbm\"} 4096\n"), std::string::npos) << text;
  EXPECT_NE(text.find("questkv_hbm_hits_total 7\n"), std::string::npos);
  EXPECT_NE(text.find("questkv_tier_capacity_bytes{tier=\"disk\"} 1048576\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE questkv_step_latency_us histogram"), std::string::npos);
  EXPECT_NE(text.find("questkv_step_latency_us_bucket{le=\"100\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("questkv_step_latency_us_bucket{le=\"2500\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("questkv_step_latency_us_bucket{le=\"5000\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("questkv_step_latency_us_bucket{le=\"5e+06\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("questkv_step_latency_us_bucket{le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("questkv_step_latency_us_count 3\n"), std::string::npos);
}

TEST(Metrics, ServerAnswersMetricsAndRefusesEverythingElse) {
  MetricsRegistry m;
  auto server = MetricsServer::Start(0, &m);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const int port = (*server)->port();
  EXPECT_EQ(Ask(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 200 OK", 0), 0u);
  EXPECT_EQ(Ask(port, "GET /other HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(Ask(port, "DELETE /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0), 0u);
  EXPECT_EQ(Ask(port, "nonsense\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(Ask(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(10000, 'a') + "\r\n\r\n").rfind("HTTP/1.1 431", 0), 0u);
  // Still serving after all that.
  EXPECT_NE(Ask(port, "GET /metrics?x=1 HTTP/1.0\r\n\r\n").find("questkv_hbm_hits_total"), std::string::npos);
  EXPECT_GE((*server)->requests_served(), 6u);
  EXPECT_EQ(MetricsServer::Start(70000, &m).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace questkv
