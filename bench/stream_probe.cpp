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
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

alignas(64) static int8_t digits[3][4096];

// 4 rows x K against 3 digit rows; PACKED: chunk c of row j at w + (4 c + j) * 64.
template <bool PACKED, bool PREFETCH>
VNNI inline void block(const int8_t* w, int64_t K, uint32_t* out) {
  __m512i acc[4][3];
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
    for (int d = 0; d < 3; ++d) {
      const __m512i q = _mm512_load_si512(digits[d] + k);
      for (int j = 0; j < 4; ++j) acc[j][d] = _mm512_dpbusd_epi32(acc[j][d], wv[j], q);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int d = 0; d < 3; ++d) out[j * 3 + d] += _mm512_reduce_add_epi32(acc[j][d]);
}

enum Variant { kRead, kPlainPf, kPackedPf, kPacked, kPacked1M };
static const char* kNames[] = {"read", "plain+pf", "packed+pf", "packed", "packed 1MiB"};

template <bool PACKED, bool PREFETCH>
VNNI void span(const int8_t* w, size_t bytes, int64_t K, uint32_t* out) {
  for (size_t off = 0; off + 4 * K <= bytes; off += 4 * K) block<PACKED, PREFETCH>(w + off, K, out);
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

int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? std::atoi(argv[1]) : 1024;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 60;
  if (K < 64 || K % 64 || K > 4096) {
    std::fprintf(stderr, "K must be a multiple of 64 in [64, 4096], got %ld\n", long(K));
    return 2;
  }
  if (!__builtin_cpu_supports("avx512vnni")) {
    std::fprintf(stderr, "this CPU has no AVX512_VNNI\n");
    return 2;
  }
  for (int i = 0; i < 3 * 4096; ++i) (&digits[0][0])[i] = int8_t(i % 11 - 5);
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
  for (const auto& [lo, hi] : std::vector<std::pair<double, double>>{{0, 42}, {42, 1e9}}) {
    std::vector<std::vector<double>> sel;
    for (const auto& r : rounds)
      if (r[kRead] >= lo && r[kRead] < hi) sel.push_back(r);
    if (sel.empty()) continue;
    std::printf("read %s %.0f GB/s, %zu rounds:", hi > 1e8 ? ">=" : "<", hi > 1e8 ? lo : hi, sel.size());
    for (int v = kRead; v <= kPacked1M; ++v) {
      std::vector<double> x;
      for (const auto& r : sel) x.push_back(r[v]);
      std::nth_element(x.begin(), x.begin() + x.size() / 2, x.end());
      std::printf(" | %s %.1f", kNames[v], x[x.size() / 2]);
    }
    std::printf(" GB/s\n");
  }
  return sink[0] == 12345 && sink[1] == 54321;   // keeps the loops
}
