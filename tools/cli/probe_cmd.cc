// questkv probe: the machine's topology and the bandwidth of every link the
// tiers use — host memory, disk (raw io_uring and through the disk tier at the
// page size in use) and host<->GPU — as a table or one JSON object.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tools/cli/flags.h"
#include "tools/cli/json.h"
#include "questkv/config.h"
#include "tiers/disk_probe.h"
#include "topology/gpu_probe.h"
#include "topology/host_memory.h"
#include "topology/memory_probe.h"
#include "topology/topology.h"

namespace questkv::cli {

namespace {

constexpr const char* kUsage =
    "usage: questkv probe [flags]   (defaults in brackets)\n"
    "disk:      --disk-dir DIR [/tmp/questkv-probe] --disk-file-bytes BYTES[K|M|G] [1G] --queue-depth 64\n"
    "page:      --page-bytes BYTES [that of run's default geometry], or the geometry it comes from:\n"
    "           --layers --kv-heads --page-size --head-dim --dtype f32|f16|bf16 (run's defaults)\n"
    "timing:    --seconds 2 (per measurement; fractions allowed)\n"
    "buffers:   --memcpy-bytes 256M --gpu-bytes 256M\n"
    "report:    --json\n";

constexpr uint64_t kMib = uint64_t(1) << 20;

struct ProbeOptions {
  std::string disk_dir = "/tmp/questkv-probe";
  uint64_t disk_file_bytes = uint64_t(1) << 30;
  std::size_t page_bytes = Geometry{}.page_bytes();
  int queue_depth = 64;
  double seconds = 2;
  std::size_t memcpy_bytes = 256 * kMib;
  std::size_t gpu_bytes = 256 * kMib;
  bool json = false;
};

// One row of the table. A non-OK status means it was not measured: shown as
// "n/a" with the reason when the machine or build cannot (Unimplemented,
// FailedPrecondition), as an error otherwise.
struct Measurement {
  std::string label;   // "host memcpy, 1 thread"
  std::string key;     // JSON key of the figure
  double gb_per_s = 0;
  Status status;
  std::string detail;  // buffer sizes, copies, block size, queue depth
};

bool NotApplicable(const Status& s) {
  return s.code() == Code::kUnimplemented || s.code() == Code::kFailedPrecondition;
}

Result<double> ParseSeconds(const Flags& f) {
  QKV_ASSIGN_OR_RETURN(std::string text, f.String("seconds", "2"));
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  // strtod skips leading spaces and takes a '+'; the other flags refuse both.
  const bool plain = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.');
  if (!plain || *end != '\0' || !(seconds > 0) || seconds > 3600)
    return Status::InvalidArgument("--seconds: '" + text + "' is not a duration in (0, 3600] seconds");
  return seconds;
}

// --page-bytes, or the page of the geometry named by the same flags as `run`.
Result<std::size_t> ParsePageBytes(const Flags& f) {
  const bool geometry_given = f.has("layers") || f.has("kv-heads") || f.has("page-size") || f.has("head-dim") ||
                              f.has("dtype");
  if (f.has("page-bytes")) {
    if (geometry_given) return Status::InvalidArgument("give --page-bytes or the geometry flags, not both");
    QKV_ASSIGN_OR_RETURN(uint64_t bytes, f.Bytes("page-bytes", 0));
    if (bytes == 0 || bytes > 64 * kMib) return Status::InvalidArgument("--page-bytes must be in 1..64M");
    return std::size_t(bytes);
  }
  Geometry g;
  QKV_ASSIGN_OR_RETURN(int64_t layers, f.Int("layers", g.layers, 1, 1024));
  QKV_ASSIGN_OR_RETURN(int64_t kv_heads, f.Int("kv-heads", g.kv_heads, 1, 1024));
  QKV_ASSIGN_OR_RETURN(int64_t page_size, f.Int("page-size", g.page_size, 1, 1024));
  QKV_ASSIGN_OR_RETURN(int64_t head_dim, f.Int("head-dim", g.head_dim, 1, 512));
  QKV_ASSIGN_OR_RETURN(std::string dtype, f.String("dtype", std::string(DTypeName(g.dtype))));
  QKV_ASSIGN_OR_RETURN(g.dtype, ParseDType(dtype));
  g.layers = int(layers), g.kv_heads = int(kv_heads), g.page_size = int(page_size), g.head_dim = int(head_dim);
  return g.page_bytes();
}

Result<ProbeOptions> ParseProbeOptions(const Flags& f) {
  ProbeOptions o;
  QKV_ASSIGN_OR_RETURN(o.disk_dir, f.String("disk-dir", o.disk_dir));
  QKV_ASSIGN_OR_RETURN(o.disk_file_bytes, f.Bytes("disk-file-bytes", o.disk_file_bytes));
  QKV_ASSIGN_OR_RETURN(o.page_bytes, ParsePageBytes(f));
  if (o.disk_file_bytes < 2 * o.page_bytes) return Status::InvalidArgument("--disk-file-bytes must hold two pages");
  QKV_ASSIGN_OR_RETURN(int64_t depth, f.Int("queue-depth", o.queue_depth, 1, 4096));
  o.queue_depth = int(depth);
  QKV_ASSIGN_OR_RETURN(o.seconds, ParseSeconds(f));
  QKV_ASSIGN_OR_RETURN(uint64_t memcpy_bytes, f.Bytes("memcpy-bytes", o.memcpy_bytes));
  QKV_ASSIGN_OR_RETURN(uint64_t gpu_bytes, f.Bytes("gpu-bytes", o.gpu_bytes));
  if (memcpy_bytes < kMib || gpu_bytes < kMib) return Status::InvalidArgument("--memcpy-bytes and --gpu-bytes: at least 1M");
  o.memcpy_bytes = memcpy_bytes, o.gpu_bytes = gpu_bytes;
  o.json = f.has("json");
  return o;
}

std::string SizeText(uint64_t bytes) {
  char buf[32];
  if (bytes % (1024 * kMib) == 0) {
    std::snprintf(buf, sizeof buf, "%llu GiB", static_cast<unsigned long long>(bytes / (1024 * kMib)));
  } else if (bytes % kMib == 0) {
    std::snprintf(buf, sizeof buf, "%llu MiB", static_cast<unsigned long long>(bytes / kMib));
  } else if (bytes % 1024 == 0) {
    std::snprintf(buf, sizeof buf, "%llu KiB", static_cast<unsigned long long>(bytes / 1024));
  } else {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

std::string SecondsText(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", seconds);
  return buf;
}

// ---- host memory ----------------------------------------------------------------

Measurement MeasureMemcpy(std::size_t bytes, int threads, double seconds, std::string label, std::string key) {
  Measurement m{std::move(label), std::move(key), 0, Status::Ok(), ""};
  auto bw = MeasureMemcpyBandwidth(bytes, threads, seconds);
  if (!bw.ok()) {
    m.status = bw.status();
    return m;
  }
  m.gb_per_s = bw->gb_per_s;
  m.detail = SizeText(bytes) + " buffers, " + SizeText(bw->slice_bytes) + " per copy";
  return m;
}

// ---- disk ---------------------------------------------------------------------

struct DiskSection {
  std::vector<Measurement> rows;
  Result<DiskProbeResult> result = Status::Unimplemented("not measured");
};

// One interleaved ProbeDiskReads run gives every disk row: random reads of
// whole pages raw (bytes untouched, then read once as they land) and through
// the tier, and the tier's fill (demotion) rate.
DiskSection MeasureDisk(const ProbeOptions& o) {
  DiskSection d;
  d.result = ProbeDiskReads(o.disk_dir, o.disk_file_bytes, o.page_bytes, o.queue_depth, o.seconds);
  const std::string pattern = "random " + SizeText(o.page_bytes) + " reads, qd " + std::to_string(o.queue_depth);
  d.rows = {{"disk read, raw io_uring", "raw_uring_gb_per_s", 0, Status::Ok(), pattern},
            {"disk read, raw io_uring, bytes touched", "raw_uring_touched_gb_per_s", 0, Status::Ok(), pattern},
            {"disk read, disk tier over io_uring", "tier_uring_gb_per_s", 0, Status::Ok(), pattern},
            {"disk read, disk tier over pread pool", "tier_pread_gb_per_s", 0, Status::Ok(), pattern},
            {"disk write, disk tier over io_uring", "tier_write_gb_per_s", 0, Status::Ok(), "filling the tier"}};
  if (!d.result.ok()) {
    for (Measurement& m : d.rows) m.status = d.result.status();
    return d;
  }
  const DiskProbeResult& r = *d.result;
  const double figures[] = {r.raw_uring_gbps, r.raw_uring_touched_gbps, r.tier_uring_gbps, r.tier_pread_gbps,
                            r.tier_write_gbps};
  const std::string where = ", " + SizeText(r.file_bytes) + (r.direct ? " files, O_DIRECT" : " files, page cache");
  for (std::size_t i = 0; i < d.rows.size(); ++i) {
    d.rows[i].gb_per_s = figures[i];
    d.rows[i].detail += where;
  }
  return d;
}

// ---- host <-> GPU -----------------------------------------------------------------

// Two rows per GPU: pinned host -> device and back, the host buffer on the
// GPU's NUMA node as the host tier's would be.
void MeasureGpus(const ProbeOptions& o, const TopologySummary& topo, std::vector<Measurement>* rows) {
  if (topo.gpus.empty()) {
    // The reason is in the topology above (and "reason" in JSON); once is enough.
    const Status none = Status::Unimplemented("no GPU");
    rows->push_back({"host->GPU, pinned", "h2d_gb_per_s", 0, none, ""});
    rows->push_back({"GPU->host, pinned", "d2h_gb_per_s", 0, none, ""});
    return;
  }
  for (const GpuInfo& gpu : topo.gpus) {
    const std::string id = std::to_string(gpu.device);
    Measurement h2d{"host->GPU " + id + ", pinned", "gpu" + id + "_h2d_gb_per_s", 0, Status::Ok(), ""};
    Measurement d2h{"GPU " + id + "->host, pinned", "gpu" + id + "_d2h_gb_per_s", 0, Status::Ok(), ""};
    auto host = HostRegion::Allocate(o.gpu_bytes, {gpu.numa_node, /*pin_for_gpu=*/true});
    auto bw = host.ok() ? MeasureHostDeviceBandwidth(gpu.device, host->data(), o.gpu_bytes, o.seconds)
                        : Result<HostDeviceBandwidth>(host.status());
    if (bw.ok()) {
      h2d.gb_per_s = bw->h2d_gb_per_s, d2h.gb_per_s = bw->d2h_gb_per_s;
      const std::string kind = host->pinned() ? "" : " (pageable: pinning failed)";
      h2d.detail = SizeText(o.gpu_bytes) + " x " + std::to_string(bw->copies_h2d) + kind;
      d2h.detail = SizeText(o.gpu_bytes) + " x " + std::to_string(bw->copies_d2h) + kind;
    } else {
      h2d.status = d2h.status = bw.status();
    }
    rows->push_back(std::move(h2d));
    rows->push_back(std::move(d2h));
  }
}

// ---- output -----------------------------------------------------------------------

std::string FormatTable(const ProbeOptions& o, const TopologySummary& topo, const std::vector<Measurement>& rows) {
  std::string out = "questkv probe\n" + topo.Describe() + "\n";
  char line[512];
  std::snprintf(line, sizeof line, "%-40s %9s  %s\n", "measurement", "GB/s", "detail");
  out += line;
  for (const Measurement& m : rows) {
    if (m.status.ok()) {
      std::snprintf(line, sizeof line, "%-40s %9.2f  %s\n", m.label.c_str(), m.gb_per_s, m.detail.c_str());
    } else {
      const char* what = NotApplicable(m.status) ? "n/a" : "error";
      std::snprintf(line, sizeof line, "%-40s %9s  %s\n", m.label.c_str(), what, m.status.message().c_str());
    }
    out += line;
  }
  out += "GB/s = 1e9 bytes per second; memcpy counts bytes copied (memory traffic is twice that); " +
         SecondsText(o.seconds) + " s per measurement.\n";
  return out;
}

void TopologyJson(const TopologySummary& topo, JsonWriter* j) {
  j->BeginObject("topology").Field("summary", topo.ToString()).Field("numa_nodes", topo.numa_nodes);
  j->Field("cores", topo.cores).Field("hardware_threads", topo.hardware_threads).Field("cpu_model", topo.cpu_model);
  j->BeginArray("nodes");
  for (const NumaNodeInfo& n : topo.nodes)
    j->BeginObject()
        .Field("os_index", n.os_index)
        .Field("memory_bytes", n.memory_bytes)
        .Field("cores", n.cores)
        .Field("hardware_threads", n.hardware_threads)
        .EndObject();
  j->EndArray().BeginArray("gpus");
  for (const GpuInfo& g : topo.gpus)
    j->BeginObject()
        .Field("device", g.device)
        .Field("pci_bus_id", g.pci_bus_id)
        .Field("name", g.name)
        .Field("memory_bytes", g.memory_bytes)
        .Field("numa_node", g.numa_node)
        .EndObject();
  j->EndArray().Field("gpus_none_reason", topo.gpus_none_reason).BeginArray("block_devices");
  for (const BlockDeviceInfo& b : topo.block_devices)
    j->BeginObject()
        .Field("name", b.name)
        .Field("size_bytes", b.size_bytes)
        .Field("numa_node", b.numa_node)
        .Field("found_by", b.found_by)
        .EndObject();
  j->EndArray().EndObject();
}

// A figure under its key, or "<key>_error" with the reason it is missing.
void MeasurementJson(const Measurement& m, JsonWriter* j) {
  if (m.status.ok()) {
    j->Field(m.key, m.gb_per_s);
  } else {
    j->Field(m.key + "_error", m.status.message());
  }
}

void DiskJson(const ProbeOptions& o, const DiskSection& disk, JsonWriter* j) {
  j->BeginObject("disk");
  if (disk.result.ok()) {
    const DiskProbeResult& r = *disk.result;
    j->Field("block_bytes", uint64_t(r.block_bytes)).Field("queue_depth", r.queue_depth);
    j->Field("file_bytes", r.file_bytes).Field("direct", r.direct).Field("uring_backend", r.uring_backend);
  } else {
    j->Field("block_bytes", uint64_t(o.page_bytes)).Field("queue_depth", o.queue_depth);
  }
  for (const Measurement& m : disk.rows) MeasurementJson(m, j);
  j->EndObject();
}

std::string FormatJson(const ProbeOptions& o, const TopologySummary& topo, const std::vector<Measurement>& memcpy_rows,
                       const DiskSection& disk, const std::vector<Measurement>& gpu_rows, int threads) {
  JsonWriter j;
  j.BeginObject().Field("command", "probe");
  TopologyJson(topo, &j);
  j.BeginObject("settings")
      .Field("disk_dir", o.disk_dir)
      .Field("disk_file_bytes", o.disk_file_bytes)
      .Field("page_bytes", uint64_t(o.page_bytes))
      .Field("queue_depth", o.queue_depth)
      .Field("seconds", o.seconds)
      .Field("memcpy_bytes", uint64_t(o.memcpy_bytes))
      .Field("gpu_bytes", uint64_t(o.gpu_bytes))
      .EndObject();
  j.BeginObject("memcpy").Field("counting", "bytes copied; memory traffic is twice this").Field("threads", threads);
  for (const Measurement& m : memcpy_rows) MeasurementJson(m, &j);
  j.EndObject();
  DiskJson(o, disk, &j);
  j.BeginObject("host_gpu").Field("available", !topo.gpus.empty());
  if (topo.gpus.empty()) j.Field("reason", topo.gpus_none_reason);
  for (const Measurement& m : gpu_rows) MeasurementJson(m, &j);
  j.EndObject().EndObject();
  return j.str();
}

bool AnyError(const std::vector<Measurement>& rows) {
  for (const Measurement& m : rows)
    if (!m.status.ok() && !NotApplicable(m.status)) return true;
  return false;
}

}  // namespace

int ProbeMain(int argc, char** argv) {
  Flags flags({"disk-dir", "disk-file-bytes", "page-bytes", "layers", "kv-heads", "page-size", "head-dim", "dtype",
               "queue-depth", "seconds", "memcpy-bytes", "gpu-bytes"},
              {"json", "help"});
  if (Status s = flags.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "questkv probe: %s\n%s", s.message().c_str(), kUsage);
    return 2;
  }
  if (flags.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  auto options = ParseProbeOptions(flags);
  if (!options.ok()) {
    std::fprintf(stderr, "questkv probe: %s\n", options.status().ToString().c_str());
    return 2;
  }
  auto topo = DiscoverTopology();
  if (!topo.ok()) {
    std::fprintf(stderr, "questkv probe: %s\n", topo.status().ToString().c_str());
    return 1;
  }
  const ProbeOptions& o = *options;
  const int threads = std::max(1, topo->hardware_threads);
  const std::vector<Measurement> memcpy_rows = {
      MeasureMemcpy(o.memcpy_bytes, 1, o.seconds, "host memcpy, 1 thread", "single_thread_gb_per_s"),
      MeasureMemcpy(o.memcpy_bytes, threads, o.seconds, "host memcpy, all " + std::to_string(threads) + " threads",
                    "all_threads_gb_per_s")};
  const DiskSection disk = MeasureDisk(o);
  std::vector<Measurement> gpu_rows;
  MeasureGpus(o, *topo, &gpu_rows);

  if (o.json) {
    std::printf("%s\n", FormatJson(o, *topo, memcpy_rows, disk, gpu_rows, threads).c_str());
  } else {
    std::vector<Measurement> rows = memcpy_rows;
    rows.insert(rows.end(), disk.rows.begin(), disk.rows.end());
    rows.insert(rows.end(), gpu_rows.begin(), gpu_rows.end());
    std::fputs(FormatTable(o, *topo, rows).c_str(), stdout);
  }
  return AnyError(memcpy_rows) || AnyError(disk.rows) || AnyError(gpu_rows) ? 1 : 0;
}

}  // namespace questkv::cli
