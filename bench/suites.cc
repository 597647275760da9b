#include "suites.h"

namespace cxlkv::bench {

const std::vector<Suite>& Suites() {
  static const std::vector<Suite> suites = {
      {"region",
       "coherence primitives: clflush/clflushopt/clwb cost per line vs DRAM latency; "
       "non-temporal copy vs memcpy bandwidth at 4 KiB..256 MiB",
       &RunRegionBench},
      {"lock", "two-tier lock acquire+release, 1/2/4 processes, vs a process-shared pthread mutex",
       &RunLockBench},
      {"alloc", "pool alloc+free pairs/s, 256 B and 2 MiB objects, vs malloc; exact-size slots vs rounded", &RunAllocBench},
      {"cache",
       "prefix cache: lookup ns/block for chains of 1/16/256; put/get GB/s of 2 MiB blocks vs the bare "
       "copy, and vs a local redis-server",
       &RunCacheBench},
      {"transfer",
       "batched gather-write / scatter-read of Llama-8B and Qwen-32B shaped blocks vs the contiguous copy "
       "of the same bytes and vs a naive per-piece loop",
       &RunTransferBench},
      {"e2e",
       "end-to-end serving of a repeated-document workload: the cxlkv shared pool's TTFT and throughput vs "
       "no reuse, a private DRAM cache, and a TCP handoff, in the same run",
       &RunE2eBench},
      {"rpc",
       "shared-memory RPC: 64-byte round trip at queue depth 1 vs a cache-line ping-pong and vs TCP loopback; "
       "single-server-thread throughput at queue depth 128",
       &RunRpcBench},
      {"tier",
       "capacity tiers: SSD tier read/write GB/s at 256 KiB and 2 MiB, queue depth 1 and 32, vs fio on the same "
       "file and vs a file-per-object store; CRC-32C cost; DRAM+SSD with placement vs each alone",
       &RunTierBench},
      {"pnm",
       "near-memory sparse attention (decode, fp16 KV, cold cache): Attend and SelectPages bytes/s vs memory read "
       "bandwidth; dense vs sparse decode step at 32K/128K/1M tokens, budgets 1/8 and 1/32, vs the byte-count "
       "limit; link bytes near memory vs recalling the selected pages",
       &RunPnmBench},
      {"longctx",
       "long-context decode with the reference engine at 128K and 1M tokens: a whole step with near-memory sparse "
       "and hybrid attention (budgets 1/8, 1/32) vs dense, bytes reaching the engine, attention mass kept",
       &RunLongContextBench},
      {"capacity",
       "KV held of what the pool is given: one process fills a fresh pool to 2x its data area with blocks of "
       "4 KiB..9 MiB (real models' shapes) and a three-model mix; KV bytes still held vs the data area",
       &RunCapacityBench},
      {"trace",
       "capacity as hit rate: a serving trace with prefix block ids (--trace FILE: the Mooncake conversation trace) "
       "replayed into a pool holding a third of its distinct blocks, at 2 MiB- and 0.875 MiB-shaped blocks, vs an "
       "exact-size LRU simulation of the same pool size",
       &RunTraceBench},
      {"racks",
       "beyond one rack: fetch of 2 MiB blocks from another rack's pool over the rack link (UCX), batches of 1 and "
       "16, vs ucx_perftest's active-message bandwidth on the same transport",
       &RunRacksBench},
  };
  return suites;
}

Result<nlohmann::json> RunSuite(const std::string& name, const BenchOptions& options) {
  std::string known;
  for (const Suite& s : Suites()) {
    if (name == s.name) return s.run(options);
    known += known.empty() ? s.name : std::string(", ") + s.name;
  }
  return NotFound("no benchmark suite named '" + name + "'; known suites: " + known);
}

}  // namespace cxlkv::bench
