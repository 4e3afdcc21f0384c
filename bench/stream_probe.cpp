// Which access pattern lets the int8 VNNI decode arithmetic read at the memory
// bandwidth (bench/RESULTS.md, "Packed expert rows"): a standalone probe, no torch.
//
//   g++ -O3 -march=x86-64-v4 -fopenmp bench/stream_probe.cpp -o /tmp/stream_probe
//   /tmp/stream_probe [K=1024] [seconds=60]
//
// Two threads stream a 512 MiB int8 buffer on huge pages (cold: 16x the L3) in chunks,
// each thread half a chunk, one fork/join per chunk, with the decode kernel's inner
// loop (csrc/cpu/int8_vnni.h's dot_digits<4, 1>: 4 weight rows side by side, 3 digit
// rows, 12 vpdpbusd per 256 weight bytes) in these variants:
//   read        plain loads and adds, no arithmetic (the pattern's ceiling)
//   plain+pf    rows K bytes apart, software prefetch (T1) 8 KiB ahead: the plain-row kernel
//   packed+pf   the 4 rows' 64-byte chunks interleaved (pack_rows4), the same prefetch
//   packed      packed, no software prefetch (5 MiB chunks; and 1 MiB: shorter runs)
// GB/s of each, round after round, for `seconds`; then the medians of the rounds grouped
// by what `read` measured in the same round (this host's bandwidth swings 30-60 GB/s
// within minutes, so only same-round figures compare).
//
//   /tmp/stream_probe moe [seconds=60]
//
// The MoE decode's own access pattern instead (fused_moe_int8, `small`: experts of gate/up
// [512, 1024] and down [1024, 256] int8, packed): per call n experts chosen at random from
// 448 (336 MiB, 10x the L3), their gate/up blocks as one flat list of 4-row tiles split in
// half between the two threads, a fork/join, then their down blocks likewise: what bounds
// any kernel that reads those bytes, as a fraction of `read` in the same round. Variants:
//   moe read        plain loads over the pattern (its ceiling, with the kernel's fork/joins)
//   moe read 1fj    the same with one fork/join a call (each thread its gate/up share, then its down share)
//   moe kernel      the packed decode arithmetic over the pattern (m activation rows per expert)
//   kernel halves   the same, each expert's rows halved between the threads (both in one expert at a time)
//   rows_digits     csrc/cpu/int8_vnni.h's packed_rows_digits itself (fused_moe_int8's decode loop) over the
//                   pattern (the others read 4-row tiles, the layout before the 16-row groups)
// at n, m = 6, 1 (T=1, top-6 of 64), 20, 1 (T=4) and 51, 2 (T=16; ~1.9 rows per chosen expert).
//
//   /tmp/stream_probe routed [seconds=60]
//
// T = 16 as the op meets it: each call routes 16 tokens to 6 of 64 experts (1-5 rows each,
// ~1.9 on average) drawn from the 448, each thread its half of the chosen experts (whole
// experts), a fork/join for the gate/up blocks and one for the down blocks. Against a long
// read (each thread one 256 MiB stream in one region, as torch's W.sum() that
// gemv_bench.py divides by): the read in 5 MiB forks, plain loads over the routed pattern,
// and packed_rows_digits over it with each expert's own rows.
//
//   /tmp/stream_probe rows
//
// rows_digits (plain rows, blocks of 4) and packed_rows_digits (groups of 16) hot in L2 on one
// thread at K = 256, 512, 1024 (what a block costs beyond its products).
//
//   /tmp/stream_probe cores
//
// What crossing between the two cores costs: a round trip through one cache line, and reading
// 256 KiB the other core just wrote (this host's vCPUs share a CCD in some hours and not in others).
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../csrc/cpu/int8_vnni.h"

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static int8_t* huge_buffer(size_t n) {
  const size_t huge = size_t(2) << 20;
  void* p = mmap(nullptr, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::exit(1);
  auto* a = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1));
  madvise(a, n, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) a[i] = int8_t(i * 7 + 3);
  return a;
}

alignas(64) static int8_t digits[2][3][4096];   // [activation row][digit][k]

// 4 rows x K against M activation rows of 3 digits; PACKED: chunk c of row j at w + (4 c + j) * 64.
template <bool PACKED, bool PREFETCH, int M = 1>
VNNI inline void block(const int8_t* w, int64_t K, uint32_t* out) {
  __m512i acc[4][3 * M];
  for (auto& a : acc)
    for (auto& d : a) d = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t k = 0; k < K; k += 64) {
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) {
      const int8_t* p = PACKED ? w + k * 4 + j * 64 : w + j * K + k;
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + 8192 + k * 4 + j * 64), _MM_HINT_T1);
    }
    for (int d = 0; d < 3 * M; ++d) {
      const __m512i q = _mm512_load_si512(digits[d / 3][d % 3] + k);
      for (int j = 0; j < 4; ++j) acc[j][d] = _mm512_dpbusd_epi32(acc[j][d], wv[j], q);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int d = 0; d < 3 * M; ++d) out[(j * 3 * M + d) % 16] += _mm512_reduce_add_epi32(acc[j][d]);
}

enum Variant { kRead, kPlainPf, kPackedPf, kPacked, kPacked1M };
static const char* kNames[] = {"read", "plain+pf", "packed+pf", "packed", "packed 1MiB"};

template <bool PACKED, bool PREFETCH, int M = 1>
VNNI void span(const int8_t* w, size_t bytes, int64_t K, uint32_t* out) {
  for (size_t off = 0; off + 4 * K <= bytes; off += 4 * K) block<PACKED, PREFETCH, M>(w + off, K, out);
}

VNNI void read_only(const int8_t* w, size_t bytes, uint32_t* out) {
  __m512i a = _mm512_setzero_si512(), b = a;
  for (size_t off = 0; off < bytes; off += 128) {
    a = _mm512_add_epi32(a, _mm512_loadu_si512(w + off));
    b = _mm512_add_epi32(b, _mm512_loadu_si512(w + off + 64));
  }
  out[0] += _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}

static double gbps(Variant v, const int8_t* w, size_t total, int64_t K, uint32_t* sink) {
  const size_t chunk = v == kPacked1M ? size_t(1) << 20 : size_t(5) << 20;
  const auto t0 = std::chrono::steady_clock::now();
  size_t done = 0;
  for (size_t base = 0; base + chunk <= total; base += chunk, done += chunk) {
#pragma omp parallel num_threads(2)
    {
      const int t = omp_get_thread_num();
      const int8_t* p = w + base + t * (chunk / 2);
      uint32_t out[16] = {0};
      switch (v) {
        case kRead: read_only(p, chunk / 2, out); break;
        case kPlainPf: span<false, true>(p, chunk / 2, K, out); break;
        case kPackedPf: span<true, true>(p, chunk / 2, K, out); break;
        default: span<true, false>(p, chunk / 2, K, out); break;
      }
      sink[t] += out[0];
    }
  }
  return done / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

// ---- the MoE decode pattern (`moe` mode) ----
constexpr int64_t kExperts = 448, kGateUp = 512 * 1024, kDown = 1024 * 256;   // bytes per expert

enum MoeVariant { kMoeRead, kMoeRead1, kMoeKernel, kMoeKernelHalves, kMoeRows };
static const char* kMoeNames[] = {"moe read", "moe read 1fj", "moe kernel", "kernel halves", "rows_digits"};
static glm5::cpu::vnni::ActDigits* g_digits[2];   // K = 1024, 256
static float g_scale[1024], g_y[2 * 1024];

// Thread t's half of the flat 4-row tile list over `chosen` blocks of `bytes` (rows of K bytes) at base.
template <int M>
VNNI void moe_share(MoeVariant v, const int8_t* base, const std::vector<int>& chosen, int64_t bytes, int64_t K,
                    int t, uint32_t* out) {
  const int64_t tile = 4 * K, per = bytes / tile, tiles = int64_t(chosen.size()) * per;
  if (v == kMoeKernelHalves) {   // thread t: half t of every expert (both threads in one expert at a time)
    for (int c : chosen)
      span<true, false, M>(base + c * bytes + t * (per / 2) * tile, (per / 2) * tile, K, out);
    return;
  }
  const int64_t t0 = tiles * t / 2, t1 = tiles * (t + 1) / 2;
  for (int64_t i = t0; i < t1;) {   // one run per expert, as the kernel's run_digits
    const int64_t e = i / per, end = std::min(t1, (e + 1) * per);
    const int8_t* w = base + chosen[e] * bytes;
    if (v == kMoeRows)   // the real kernel's loop over the run's rows (whole 16-row groups: per % 4 == 0)
      glm5::cpu::vnni::packed_rows_digits(*g_digits[K == 1024 ? 0 : 1], 0, M, w, bytes / K, (i - e * per) * 4,
                                          (end - e * per) * 4, g_scale, nullptr, g_y, bytes / K);
    else if (v == kMoeKernel)
      span<true, false, M>(w + (i - e * per) * tile, (end - i) * tile, K, out);
    else
      read_only(w + (i - e * per) * tile, (end - i) * tile, out);
    i = end;
  }
}

template <int M>
VNNI double moe_gbps(MoeVariant v, const int8_t* w, int n, uint32_t* sink, unsigned* seed) {
  const int8_t *gate_up = w, *down = w + kExperts * kGateUp;
  const int calls = int((int64_t(256) << 20) / (n * (kGateUp + kDown))) + 1;
  std::vector<std::vector<int>> routes(calls);
  for (auto& r : routes) {   // n distinct experts, ascending (as the kernel's `active`)
    std::vector<int> all(kExperts);
    for (int i = 0; i < kExperts; ++i) all[i] = i;
    for (int i = 0; i < n; ++i) std::swap(all[i], all[i + rand_r(seed) % (kExperts - i)]);
    r.assign(all.begin(), all.begin() + n);
    std::sort(r.begin(), r.end());
  }
  // One parallel region over the chosen gate/up blocks, the down blocks, or both.
  const auto region = [&](const std::vector<int>& r, bool gate_up_share, bool down_share) {
#pragma omp parallel num_threads(2)
    {
      const int t = omp_get_thread_num();
      uint32_t out[16] = {0};
      if (gate_up_share) moe_share<M>(v, gate_up, r, kGateUp, 1024, t, out);
      if (down_share) moe_share<M>(v, down, r, kDown, 256, t, out);
      sink[t] += out[0];
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& r : routes) {
    if (v == kMoeRead1) {
      region(r, true, true);
    } else {
      region(r, true, false);
      region(r, false, true);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(calls) * n * (kGateUp + kDown) / s / 1e9;
}

static std::vector<double> medians(const std::vector<std::vector<double>>& rounds) {
  std::vector<double> m;
  for (size_t v = 0; v < rounds[0].size(); ++v) {
    std::vector<double> x;
    for (const auto& r : rounds) x.push_back(r[v]);
    std::nth_element(x.begin(), x.begin() + x.size() / 2, x.end());
    m.push_back(x[x.size() / 2]);
  }
  return m;
}

// The rounds grouped by what `read` (each round's first figure) measured, below 42 GB/s and
// from 42 up: prints the group's header and hands fn the group's per-figure medians.
template <class F>
static void by_read(const std::vector<std::vector<double>>& rounds, F fn) {
  for (const auto& [lo, hi] : std::vector<std::pair<double, double>>{{0, 42}, {42, 1e9}}) {
    std::vector<std::vector<double>> sel;
    for (const auto& r : rounds)
      if (r[0] >= lo && r[0] < hi) sel.push_back(r);
    if (sel.empty()) continue;
    std::printf("read %s %.0f GB/s, %zu rounds:", hi > 1e8 ? ">=" : "<", hi > 1e8 ? lo : hi, sel.size());
    fn(medians(sel));
  }
}

static int moe_main(double seconds) {
  const int8_t* w = huge_buffer(size_t(kExperts) * (kGateUp + kDown));
  const int8_t* plain = huge_buffer(size_t(512) << 20);
  static float x[2][1024];
  for (int i = 0; i < 2 * 1024; ++i) (&x[0][0])[i] = float(i % 13) - 6.f;
  g_digits[0] = new glm5::cpu::vnni::ActDigits(glm5::cpu::vnni::make_digits(&x[0][0], 2, 1024, 1024));
  g_digits[1] = new glm5::cpu::vnni::ActDigits(glm5::cpu::vnni::make_digits(&x[0][0], 2, 256, 1024));
  for (auto& v : g_scale) v = 1.f;
  uint32_t sink[2] = {0, 0};
  unsigned seed = 1;
  struct Case { int n, m; const char* name; } cases[] = {{6, 1, "T=1"}, {20, 1, "T=4"}, {51, 2, "T=16"}};
  // per round: read, then per case each variant
  std::vector<std::vector<double>> rounds;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    std::vector<double> r{gbps(kRead, plain, size_t(512) << 20, 1024, sink)};
    for (const auto& c : cases)
      for (int v = kMoeRead; v <= kMoeRows; ++v)
        r.push_back(c.m == 1 ? moe_gbps<1>(MoeVariant(v), w, c.n, sink, &seed)
                             : moe_gbps<2>(MoeVariant(v), w, c.n, sink, &seed));
    rounds.push_back(r);
    std::printf("read %.1f", r[0]);
    for (size_t c = 0; c < 3; ++c)
      std::printf(" | %s %.1f / %.1f / %.1f / %.1f / %.1f", cases[c].name, r[1 + 5 * c], r[2 + 5 * c], r[3 + 5 * c], r[4 + 5 * c], r[5 + 5 * c]);
    std::printf(" GB/s (moe read / read 1fj / kernel / halves / rows_digits)\n");
    std::fflush(stdout);
  }
  std::printf("\nmedians by the round's read bandwidth, GB/s and %% of read:\n");
  by_read(rounds, [&](const std::vector<double>& m) {
    std::printf(" read %.1f\n", m[0]);
    for (size_t c = 0; c < 3; ++c) {
      std::printf("  %-4s", cases[c].name);
      for (int v = 0; v < 5; ++v) std::printf(" | %s %.1f (%.0f%%)", kMoeNames[v], m[1 + 5 * c + v], 100 * m[1 + 5 * c + v] / m[0]);
      std::printf("\n");
    }
  });
  return sink[0] == 12345 && sink[1] == 54321;
}

// `routed` mode (see the top).
struct Routed {
  std::vector<int> experts, rows;   // chosen experts of the 448, ascending; their rows
};

static std::vector<Routed> routed_calls(unsigned* seed) {
  std::vector<Routed> calls;
  int64_t bytes = 0;
  while (bytes < (int64_t(256) << 20)) {   // past the L3 many times
    std::vector<int> count(64, 0), pool(kExperts);
    for (int t = 0; t < 16; ++t) {
      int ids[64];
      for (int i = 0; i < 64; ++i) ids[i] = i;
      for (int i = 0; i < 6; ++i) {
        std::swap(ids[i], ids[i + rand_r(seed) % (64 - i)]);
        ++count[ids[i]];
      }
    }
    for (int i = 0; i < kExperts; ++i) pool[i] = i;
    for (int i = 0; i < 64; ++i) std::swap(pool[i], pool[i + rand_r(seed) % (kExperts - i)]);
    std::vector<std::pair<int, int>> chosen;
    for (int e = 0; e < 64; ++e)
      if (count[e]) chosen.push_back({pool[e], count[e]});
    std::sort(chosen.begin(), chosen.end());
    Routed c;
    for (auto [e, m] : chosen) c.experts.push_back(e), c.rows.push_back(m);
    bytes += int64_t(c.experts.size()) * (kGateUp + kDown);
    calls.push_back(c);
  }
  return calls;
}

// GB/s over the calls: per call a region over the gate/up blocks and one over the down blocks.
VNNI double routed_gbps(const int8_t* w, const std::vector<Routed>& calls, bool kernel, const glm5::cpu::vnni::ActDigits& gu,
                        const glm5::cpu::vnni::ActDigits& dn, uint32_t* sink) {
  static float y[16 * 1024];
  double bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& c : calls) {
    const int n = int(c.experts.size());
    for (int part = 0; part < 2; ++part) {
      const int8_t* base = part == 0 ? w : w + kExperts * kGateUp;
      const int64_t block = part == 0 ? kGateUp : kDown, N = part == 0 ? 512 : 1024;
#pragma omp parallel num_threads(2)
      {
        const int t = omp_get_thread_num();
        uint32_t out[16] = {0};
        for (int i = n * t / 2; i < n * (t + 1) / 2; ++i) {
          const int8_t* b = base + c.experts[i] * block;
          if (kernel)
            glm5::cpu::vnni::packed_rows_digits(part == 0 ? gu : dn, 0, c.rows[i], b, N, 0, N, g_scale, nullptr, y, 1024);
          else
            read_only(b, block, out);
        }
        sink[t] += out[0];
      }
    }
    bytes += double(n) * (kGateUp + kDown);
  }
  return bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

static int routed_main(double seconds) {
  const int8_t* w = huge_buffer(size_t(kExperts) * (kGateUp + kDown));
  const size_t total = size_t(512) << 20;
  const int8_t* plain = huge_buffer(total);
  static float x[16][1024];
  unsigned seed = 1;
  for (auto& r : x)
    for (auto& v : r) v = float(int(rand_r(&seed) % 2001) - 1000) / 300.f;
  const auto gu = glm5::cpu::vnni::make_digits(&x[0][0], 16, 1024, 1024);
  const auto dn = glm5::cpu::vnni::make_digits(&x[0][0], 16, 256, 1024);
  for (auto& v : g_scale) v = 1.f;
  const std::vector<Routed> calls = routed_calls(&seed);
  double experts = 0, rows = 0;
  for (const auto& c : calls) experts += c.experts.size(), rows += std::accumulate(c.rows.begin(), c.rows.end(), 0);
  std::printf("%zu calls, %.1f experts a call, %.2f rows an expert\n", calls.size(), experts / calls.size(), rows / experts);
  uint32_t sink[2] = {0, 0};
  const auto long_read = [&] {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
    {
      uint32_t out[16] = {0};
      read_only(plain + omp_get_thread_num() * (total / 2), total / 2, out);
      sink[omp_get_thread_num()] += out[0];
    }
    return double(total) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
  };
  std::vector<std::vector<double>> rounds;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds)
    rounds.push_back({long_read(), gbps(kRead, plain, total, 1024, sink), routed_gbps(w, calls, false, gu, dn, sink),
                      routed_gbps(w, calls, true, gu, dn, sink)});
  const char* names[] = {"long read", "read in 5 MiB forks", "plain loads, routed", "packed_rows_digits, routed"};
  by_read(rounds, [&](const std::vector<double>& m) {
    std::printf(" %s %.1f GB/s", names[0], m[0]);
    for (int v = 1; v < 4; ++v) std::printf(" | %s %.1f (%.0f%%)", names[v], m[v], 100 * m[v] / m[0]);
    std::printf("\n");
  });
  return sink[0] == 12345 && sink[1] == 54321;
}

// `rows` mode: rows_digits on plain rows and packed_rows_digits on the packed layout, hot
// (256 KiB of rows in L2, one thread, one activation row) at K = 256, 512, 1024: what a
// block costs beyond its vpdpbusd (4 plain rows: 3 horizontal reductions; a 16-row group: none).
static int rows_main() {
  static float x[1024], scale[1024], y[1024];
  for (int i = 0; i < 1024; ++i) x[i] = float(i % 13) - 6.f, scale[i] = 1.f;
  const int8_t* w = huge_buffer(size_t(256) << 10);
  for (int K : {256, 512, 1024}) {
    const auto d = glm5::cpu::vnni::make_digits(x, 1, K, 1024);
    const int64_t N = (int64_t(256) << 10) / K;
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 20; ++rep)
      for (int packed = 0; packed < 2; ++packed) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int it = 0; it < 200; ++it) {
          if (packed)
            glm5::cpu::vnni::packed_rows_digits(d, 0, 1, w, N, 0, N, scale, nullptr, y, N);
          else
            glm5::cpu::vnni::rows_digits(d, 0, 1, w, 0, N, scale, nullptr, y, N);
        }
        best[packed] = std::min(best[packed], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 200);
      }
    std::printf("K=%d, 256 KiB: rows_digits %.2f us (%.1f GB/s), packed_rows_digits %.2f us (%.1f GB/s)\n", K,
                best[0] * 1e6, (256 << 10) / best[0] / 1e9, best[1] * 1e6, (256 << 10) / best[1] / 1e9);
  }
  return 0;
}

// `cores` mode: thread 0 and 1 pass a counter back and forth (a round trip through one line),
// then thread 1 writes 256 KiB that thread 0 reads (best of 50).
static int cores_main() {
  alignas(64) static std::atomic<int64_t> flag{0};
  static std::vector<char> buf(size_t(256) << 10);
  constexpr int64_t kTrips = 200000;
  double trip = 0, read = 1e9;
#pragma omp parallel num_threads(2)
  {
    const int t = omp_get_thread_num();
    if (t == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < kTrips; ++i) {
        flag.store(2 * i + 1, std::memory_order_release);
        while (flag.load(std::memory_order_acquire) != 2 * i + 2) {}
      }
      trip = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kTrips;
    } else {
      for (int64_t i = 0; i < kTrips; ++i) {
        while (flag.load(std::memory_order_acquire) != 2 * i + 1) {}
        flag.store(2 * i + 2, std::memory_order_release);
      }
    }
#pragma omp barrier
    for (int r = 0; r < 50; ++r) {
      if (t == 1) std::memset(buf.data(), r, buf.size());
#pragma omp barrier
      if (t == 0) {
        const auto t0 = std::chrono::steady_clock::now();
        int64_t sum = 0;
        for (size_t i = 0; i < buf.size(); i += 64) sum += buf[i];
        read = std::min(read, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        if (sum == 12345) std::printf(" ");
      }
#pragma omp barrier
    }
  }
  std::printf("round trip between the threads %.0f ns; 256 KiB written by the other read in %.1f us (%.1f GB/s)\n",
              trip * 1e9, read * 1e6, buf.size() / read / 1e9);
  return 0;
}

int main(int argc, char** argv) {
  if (!__builtin_cpu_supports("avx512vnni")) {
    std::fprintf(stderr, "this CPU has no AVX512_VNNI\n");
    return 2;
  }
  for (int i = 0; i < 2 * 3 * 4096; ++i) (&digits[0][0][0])[i] = int8_t(i % 11 - 5);
  if (argc > 1 && std::string(argv[1]) == "rows") return rows_main();
  if (argc > 1 && std::string(argv[1]) == "cores") return cores_main();
  if (argc > 1 && std::string(argv[1]) == "moe") return moe_main(argc > 2 ? std::atof(argv[2]) : 60);
  if (argc > 1 && std::string(argv[1]) == "routed") return routed_main(argc > 2 ? std::atof(argv[2]) : 60);
  const int64_t K = argc > 1 ? std::atoi(argv[1]) : 1024;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 60;
  if (K < 64 || K % 64 || K > 4096) {
    std::fprintf(stderr, "K must be a multiple of 64 in [64, 4096], got %ld\n", long(K));
    return 2;
  }
  const size_t total = size_t(512) << 20;
  const int8_t* w = huge_buffer(total);
  uint32_t sink[2] = {0, 0};
  std::vector<std::vector<double>> rounds;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    std::vector<double> r;
    for (int v = kRead; v <= kPacked1M; ++v) r.push_back(gbps(Variant(v), w, total, K, sink));
    rounds.push_back(r);
    std::printf("K=%ld", long(K));
    for (int v = kRead; v <= kPacked1M; ++v) std::printf(" | %s %.1f", kNames[v], r[v]);
    std::printf(" GB/s\n");
    std::fflush(stdout);
  }
  std::printf("\nmedians by the round's read bandwidth (K=%ld):\n", long(K));
  by_read(rounds, [&](const std::vector<double>& m) {
    for (int v = kRead; v <= kPacked1M; ++v) std::printf(" | %s %.1f", kNames[v], m[v]);
    std::printf(" GB/s\n");
  });
  return sink[0] == 12345 && sink[1] == 54321;   // keeps the loops
}
