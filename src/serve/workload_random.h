// The workload generators' randomness (workload.cc, trace.cc): independent seeded streams and
// distributions written out from mt19937_64's output, because <random>'s distributions are
// implementation-defined and a request set must be the same on every build.
#ifndef CXLKV_SRC_SERVE_WORKLOAD_RANDOM_H_
#define CXLKV_SRC_SERVE_WORKLOAD_RANDOM_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace cxlkv::serve::workload_internal {

inline constexpr double kPi = 3.14159265358979323846;

// Independent random streams: each purpose draws from its own mt19937_64, seeded from
// (seed, stream, index), so e.g. a document's tokens do not depend on how many questions came
// before it.
enum class Stream : uint64_t {
  kMain = 1,      // per-request draws of the generators, in request order
  kPrefix,        // kTract's shared prefix sequences, index = prefix number
  kDocument,      // kDocQa's documents, index = document number
  kArrival,       // Poisson gaps
  kTraceGroup,    // a trace's prefix_group sequences, index = hash of the group name
  kTraceRequest,  // a synthetic trace request's own tokens, index = request id
};

// SplitMix64's finalizer: a bijective 64-bit mix.
inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t StreamSeed(uint64_t seed, Stream stream, uint64_t index) {
  return Mix(Mix(seed ^ Mix(static_cast<uint64_t>(stream))) ^ index);
}

// FNV-1a over the bytes of `s`: portable, unlike std::hash.
inline uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// mt19937_64 (whose output the standard fixes) plus distributions written out here, since
// <random>'s distributions are implementation-defined.
class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}

  // Uniform in [0, 1), 53 random bits.
  double Uniform() { return static_cast<double>(g_() >> 11) * 0x1.0p-53; }

  // Uniform in [0, n), unbiased: rejects the lowest 2^64 mod n values. REQUIRES: n >= 1.
  uint64_t Below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t r = g_();
      if (r >= threshold) return r % n;
    }
  }

  // Standard normal by Box–Muller (cosine branch only).
  double Normal() {
    const double u1 = 1.0 - Uniform();  // (0, 1]: log(u1) is finite
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * kPi * u2);
  }

  double Exponential(double mean) { return -mean * std::log(1.0 - Uniform()); }

  // Log-normal with the given mean and standard deviation (moment-matched). REQUIRES: mean > 0.
  double LogNormal(double mean, double sd) {
    const double s2 = std::log1p((sd * sd) / (mean * mean));
    return std::exp(std::log(mean) - s2 / 2 + std::sqrt(s2) * Normal());
  }

  int32_t Token(uint32_t vocab) { return static_cast<int32_t>(Below(vocab)); }

  // A token other than `avoid`, uniform over the rest. REQUIRES: vocab >= 2.
  int32_t TokenOtherThan(uint32_t vocab, int32_t avoid) {
    const auto t = static_cast<int32_t>(Below(vocab - 1));
    return t >= avoid ? t + 1 : t;
  }

  void AppendTokens(uint32_t vocab, uint64_t n, std::vector<int32_t>& out) {
    for (uint64_t i = 0; i < n; ++i) out.push_back(Token(vocab));
  }

 private:
  std::mt19937_64 g_;
};

inline std::string Num(uint64_t v) { return std::to_string(v); }

}  // namespace cxlkv::serve::workload_internal

#endif  // CXLKV_SRC_SERVE_WORKLOAD_RANDOM_H_
