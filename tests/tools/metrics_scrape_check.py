#!/usr/bin/env python3
"""Starts `questkv run` (CPU backend, tiers small enough to spill to disk) with
--metrics-port 0, scrapes /metrics over HTTP while it runs, and checks that the
counters move, never go backwards, and at the end agree with the run's JSON
report; also that bad requests get HTTP errors and the server keeps serving.
Usage: metrics_scrape_check.py QUESTKV_BINARY"""
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def fail(msg):
    print("metrics_scrape_check: FAILED: " + msg, file=sys.stderr)
    sys.exit(1)


def parse(text):
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        if r.status != 200 or not r.headers["Content-Type"].startswith("text/plain"):
            fail(f"status {r.status}, type {r.headers['Content-Type']}")
        return parse(r.read().decode())


def raw(port, payload):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0].decode(errors="replace")


def main():
    binary = sys.argv[1]
    disk = tempfile.mkdtemp(prefix="questkv-metrics-")
    cmd = [binary, "run", "--no-progress", "--json", "--context", "8192", "--steps", "400", "--recall-every", "0",
           "--dense-layers", "none", "--hbm-bytes", "1M", "--host-bytes", "1M", "--disk-dir", disk, "--disk-bytes", "256M",
           "--metrics-port", "0", "--metrics-linger-ms", "120000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    m = re.search(r"127\.0\.0\.1:(\d+)/metrics", line)
    if not m:
        proc.kill()
        fail("no metrics address on stderr: " + line)
    port = int(m.group(1))

    # Bad requests: errors, never a crash.
    for payload, want in [(b"GET /nope HTTP/1.1\r\n\r\n", "404"), (b"POST /metrics HTTP/1.1\r\n\r\n", "405"),
                          (b"garbage\r\n\r\n", "400"), (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", "431")]:
        status = raw(port, payload)
        if want not in status:
            fail(f"{payload[:30]!r} answered {status!r}, wanted {want}")

    # Scrape until the last step is published (the server lingers after it).
    samples = []
    while proc.poll() is None and len(samples) < 4000:
        samples.append(scrape(port))
        if samples[-1].get("questkv_step_latency_us_count", 0) >= 400:
            break
        time.sleep(0.05)
    final = scrape(port)
    proc.send_signal(signal.SIGTERM)  # done scraping: the run ends its linger and prints its report
    out, err = proc.communicate(timeout=120)
    if proc.returncode != 0:
        fail(f"questkv exited {proc.returncode}: {err}")
    report = json.loads(out)

    # How many scrapes land during the run depends on the machine's load, so
    # the check holds for any number: counters never go backwards, and the
    # final scrape (the server lingers until told) agrees with the report.
    moving = [s for s in samples if s.get("questkv_step_latency_us_count", 0) > 0] or [final]
    keys = ["questkv_hbm_hits_total", "questkv_hbm_misses_total", "questkv_step_latency_us_count",
            'questkv_bytes_moved_total{link="disk_to_host"}']
    for a, b in zip(samples, samples[1:]):
        for k in keys:
            if b.get(k, 0) < a.get(k, 0):
                fail(f"{k} went backwards: {a.get(k)} -> {b.get(k)}")
    for k in keys:
        if final.get(k, 0) < samples[-1].get(k, 0):
            fail(f"{k} went backwards at the end: {samples[-1].get(k)} -> {final.get(k)}")

    # The final scrape agrees with the report.
    links = {k: report["bytes_moved"][k] + report["bytes_moved_prefill"][k] + report["bytes_moved_diagnostics"][k]
             for k in report["bytes_moved"]}
    want = {
        "questkv_step_latency_us_count": report["decode_steps"],
        "questkv_hbm_hits_total": report["hbm_cache"]["hits"],
        "questkv_hbm_misses_total": report["hbm_cache"]["misses"],
        "questkv_cold_misses_total": report["disk_events"]["cold_misses"],
        "questkv_cold_stalls_total": report["disk_events"]["cold_stalls"],
        'questkv_tier_capacity_bytes{tier="hbm"}': report["tiers"]["hbm"]["capacity_bytes"],
        'questkv_tier_used_bytes{tier="disk"}': report["tiers"]["disk"]["used_bytes"],
    }
    for link, v in links.items():
        want[f'questkv_bytes_moved_total{{link="{link}"}}'] = v
    for k, v in want.items():
        if final.get(k) != v:
            fail(f"{k}: scraped {final.get(k)}, report says {v}")
    if final['questkv_bytes_moved_total{link="disk_to_host"}'] <= 0:
        fail("the run never read from disk: the check would not show the tier counters moving")
    print(f"metrics_scrape_check: {len(samples)} scrapes, {len(moving)} during decode, final agrees with the report, "
          f"4 bad requests answered with errors: passed")


if __name__ == "__main__":
    main()
