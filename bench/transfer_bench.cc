// `cxlkv bench transfer`: batched gather-write / scatter-read of whole KV blocks between an
// engine's paged layout (vLLM FlashAttention: per-layer tensors, K and V apart) and pool blocks.
//
//   llama8b   32 layers x K/V x 16 tokens x 8 heads x 128 x fp16 = 64 pieces of 32 KiB (2 MiB)
//   qwen32b   64 layers x K/V x 16 tokens x 8 heads x 80 x fp16 = 128 pieces of 20 KiB (2.5 MiB)
//
// Each figure is GB/s over a request of `blocks` blocks, next to the copy of the same total
// bytes, contiguous, in the same run (non-temporal into the pool for writes, memcpy out of it
// for reads), with the ratio; the naive loop (one memcpy per piece, no batching) is the second
// reference.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <numeric>

#include "bench_clock.h"
#include "pool/pool_internal.h"
#include "region/coherence.h"
#include "suites.h"
#include "transfer/transfer.h"

namespace cxlkv::bench {
namespace {

double Gbps(uint64_t bytes, Clock::time_point t0) {
  return static_cast<double>(bytes) / std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
}

struct Model {
  const char* name;
  uint32_t layers, heads, head_size;
};

}  // namespace

Result<nlohmann::json> RunTransferBench(const BenchOptions& options) {
  const int reps = options.quick ? 2 : options.repetitions;
  const uint32_t blocks = options.quick ? 4 : 32;
  std::string path = options.workdir + "/cxlkv-bench-transfer-" + std::to_string(::getpid());
  nlohmann::json machine = MachineJsonWithLimits(options);
  PoolCreateOptions co;
  co.size = (options.quick ? 128ull : 512ull) << 20;
  co.max_nodes = 2;
  co.overwrite = true;
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  auto pool = Pool::Open({path}, PoolOpenOptions{});
  if (!pool.ok()) return pool.status();
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, (*pool)->Cache());
  transfer::CpuTransfer xfer(*cache, {.threads = 2, .small_piece_bytes = 4096});
  // The same thread count as the contiguous references: the like-for-like ratio.
  transfer::CpuTransfer xfer1(*cache, {.threads = 1, .small_piece_bytes = 4096});
  nlohmann::json results = nlohmann::json::array();

  for (Model m : {Model{"llama8b", 32, 8, 128}, Model{"qwen32b", 64, 8, 80}}) {
    // An engine cache with `blocks` blocks per layer tensor.
    EngineKvLayout layout;
    layout.num_blocks = blocks;
    layout.num_kv_heads = m.heads;
    layout.head_size = m.head_size;
    std::vector<std::vector<uint8_t>> tensors(m.layers);
    for (auto& t : tensors) {
      t.assign(layout.num_blocks * layout.PieceBytes() * 2, 0);
      for (size_t i = 0; i < t.size(); i += 64) t[i] = static_cast<uint8_t>(i >> 6);
      layout.layers.push_back(t.data());
    }
    KeyNamespace kns;
    kns.model_id = std::string("bench-") + m.name;
    kns.layout = layout.Signature();
    CXLKV_ASSIGN_OR_RETURN(auto ns, cache->Namespace(kns));
    const uint64_t block_bytes = layout.PoolBlockBytes();
    const uint64_t total = block_bytes * blocks;
    std::vector<uint32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::vector<uint8_t> contiguous(total), out(total);
    std::vector<double> gw1, sr1, gw, sr, nt, mc, naive_w, naive_r, sparse, sparse_naive, sparse_contig;
    // A 16-token sparse read: for every layer and head, 16 tokens spread over the request.
    transfer::SparseSelection sel{m.layers, m.heads, {}};
    for (uint32_t s = 0; s < m.layers * m.heads; ++s) {
      std::vector<uint32_t> tok;
      for (uint32_t i = 0; i < 16; ++i) tok.push_back((s * 7 + i * 37) % (16 * blocks));
      sel.tokens.push_back(tok);
    }
    const uint64_t head_bytes = uint64_t{m.head_size} * 2;
    const uint64_t sparse_bytes = uint64_t{m.layers} * m.heads * 16 * 2 * head_bytes;
    std::vector<std::vector<uint8_t>> sk(m.layers, std::vector<uint8_t>(m.heads * 16 * head_bytes)), sv = sk;
    transfer::SparseDestination sdst;
    for (uint32_t l = 0; l < m.layers; ++l) {
      sdst.k.push_back(sk[l].data());
      sdst.v.push_back(sv[l].data());
    }
    sdst.capacity = 16;
    for (int rep = 0; rep < reps; ++rep) {
      std::vector<int32_t> tokens(16 * blocks);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(rep * 100000 + i);
      auto keys = KvCache::ChainKeys(ns, tokens);
      CXLKV_RETURN_IF_ERROR(cache->EvictAll().status());
      auto t0 = Clock::now();
      CXLKV_ASSIGN_OR_RETURN(auto g, xfer.GatherWrite(ns, layout, ids, keys));
      gw.push_back(Gbps(total, t0));
      if (g.written != blocks) return Internal("bench gather wrote " + std::to_string(g.written) + " blocks");
      CXLKV_ASSIGN_OR_RETURN(auto hit, cache->Lookup(ns, keys));
      t0 = Clock::now();
      CXLKV_RETURN_IF_ERROR(xfer.ScatterRead(layout, ids, hit.pins));
      sr.push_back(Gbps(total, t0));
      t0 = Clock::now();
      CXLKV_RETURN_IF_ERROR(xfer1.ScatterRead(layout, ids, hit.pins));
      sr1.push_back(Gbps(total, t0));
      // References over the same pool blocks: the bytes as one contiguous copy per block...
      t0 = Clock::now();
      for (uint32_t b = 0; b < blocks; ++b) {
        region::NtCopy(const_cast<uint8_t*>(cache->PayloadPtr(hit.pins[b])), &contiguous[b * block_bytes], block_bytes);
      }
      nt.push_back(Gbps(total, t0));
      t0 = Clock::now();
      for (uint32_t b = 0; b < blocks; ++b) {
        cache->InvalidateForRead(cache->PayloadPtr(hit.pins[b]), block_bytes);
        std::memcpy(&out[b * block_bytes], cache->PayloadPtr(hit.pins[b]), block_bytes);
      }
      mc.push_back(Gbps(total, t0));
      // ...and the naive loop: one memcpy per piece, one thread, then the flush it owes.
      t0 = Clock::now();
      for (uint32_t b = 0; b < blocks; ++b) {
        auto* dst = const_cast<uint8_t*>(cache->PayloadPtr(hit.pins[b]));
        for (uint32_t l = 0; l < layout.num_layers(); ++l) {
          for (uint32_t p = 0; p < 2; ++p) {
            std::memcpy(dst + layout.PoolPieceOffset(l, p), layout.EnginePiece(l, p, b), layout.PieceBytes());
            region::FlushLines(dst + layout.PoolPieceOffset(l, p), layout.PieceBytes());
          }
        }
      }
      naive_w.push_back(Gbps(total, t0));
      t0 = Clock::now();
      for (uint32_t b = 0; b < blocks; ++b) {
        const uint8_t* src = cache->PayloadPtr(hit.pins[b]);
        for (uint32_t l = 0; l < layout.num_layers(); ++l) {
          for (uint32_t p = 0; p < 2; ++p) {
            cache->InvalidateForRead(src + layout.PoolPieceOffset(l, p), layout.PieceBytes());
            std::memcpy(layout.EnginePiece(l, p, b), src + layout.PoolPieceOffset(l, p), layout.PieceBytes());
          }
        }
      }
      naive_r.push_back(Gbps(total, t0));
      t0 = Clock::now();
      CXLKV_RETURN_IF_ERROR(xfer.SparseRead(layout, hit.pins, sel, sdst));
      sparse.push_back(Gbps(sparse_bytes, t0));
      t0 = Clock::now();
      for (uint32_t l = 0; l < m.layers; ++l) {
        for (uint32_t h = 0; h < m.heads; ++h) {
          const auto& tok = sel.tokens[l * m.heads + h];
          for (size_t i = 0; i < tok.size(); ++i) {
            const uint8_t* block = cache->PayloadPtr(hit.pins[tok[i] / 16]);
            const uint64_t row = (uint64_t{tok[i] % 16} * m.heads + h) * head_bytes;
            for (uint32_t p = 0; p < 2; ++p) {
              const uint8_t* src = block + layout.PoolPieceOffset(l, p) + row;
              cache->InvalidateForRead(src, head_bytes);
              std::memcpy((p ? sv : sk)[l].data() + (uint64_t{h} * 16 + i) * head_bytes, src, head_bytes);
            }
          }
        }
      }
      sparse_naive.push_back(Gbps(sparse_bytes, t0));
      t0 = Clock::now();
      cache->InvalidateForRead(cache->PayloadPtr(hit.pins[0]), std::min(sparse_bytes, block_bytes));
      std::memcpy(out.data(), cache->PayloadPtr(hit.pins[0]), std::min(sparse_bytes, block_bytes));
      sparse_contig.push_back(Gbps(std::min(sparse_bytes, block_bytes), t0));
      cache->Release(hit.pins);
      // One-thread gather-write into fresh keys (the blocks above are READY: evict first).
      CXLKV_RETURN_IF_ERROR(cache->EvictAll().status());
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(rep * 100000 + 50000 + i);
      auto keys1 = KvCache::ChainKeys(ns, tokens);
      t0 = Clock::now();
      CXLKV_ASSIGN_OR_RETURN(auto g1, xfer1.GatherWrite(ns, layout, ids, keys1));
      gw1.push_back(Gbps(total, t0));
      if (g1.written != blocks) return Internal("bench gather (1 thread) wrote " + std::to_string(g1.written));
    }
    const std::string n = m.name;
    const std::string pieces = std::to_string(layout.num_layers() * 2) + " pieces of " +
                               std::to_string(layout.PieceBytes() >> 10) + " KiB per block";
    results.push_back(FigureJson({"contiguous_nt/" + n, "GB/s", true, nt, "", {}, "one non-temporal copy per block, same bytes"}));
    results.push_back(FigureJson({"contiguous_memcpy/" + n, "GB/s", true, mc, "", {}, "invalidate + one memcpy per block, same bytes"}));
    results.push_back(FigureJson({"naive_write/" + n, "GB/s", true, naive_w, "", {}, "memcpy + clflush per piece, one thread"}));
    results.push_back(FigureJson({"naive_read/" + n, "GB/s", true, naive_r, "", {}, "invalidate + memcpy per piece, one thread"}));
    results.push_back(FigureJson({"gather_write/" + n, "GB/s", true, gw, "contiguous_nt/" + n, nt,
                                  "reserve+gather+commit, " + pieces + "; goal >= 0.85", Goal::RatioAtLeast(0.85)}));
    results.push_back(FigureJson({"gather_vs_naive/" + n, "GB/s", true, gw, "naive_write/" + n, naive_w,
                                  "batched gather-write over the naive per-piece loop"}));
    results.push_back(FigureJson({"gather_write_1t/" + n, "GB/s", true, gw1, "contiguous_nt/" + n, nt,
                                  "one worker, like for like: reserve + copy + commit vs one nt copy per block",
                                  Goal::RatioAtLeast(0.85)}));
    results.push_back(FigureJson({"scatter_read_1t/" + n, "GB/s", true, sr1, "contiguous_memcpy/" + n, mc,
                                  "one worker, like for like"}));
    results.push_back(FigureJson({"scatter_read/" + n, "GB/s", true, sr, "contiguous_memcpy/" + n, mc,
                                  "scatter-read of pinned blocks, " + pieces + "; goal >= 0.85", Goal::RatioAtLeast(0.85)}));
    results.push_back(FigureJson({"sparse_contiguous/" + n, "GB/s", true, sparse_contig, "", {},
                                  "invalidate + one memcpy of the same byte count, contiguous"}));
    results.push_back(FigureJson({"sparse_naive/" + n, "GB/s", true, sparse_naive, "", {},
                                  "invalidate + memcpy per token piece, one thread"}));
    results.push_back(FigureJson({"sparse_read16/" + n, "GB/s", true, sparse, "sparse_contiguous/" + n, sparse_contig,
                                  "16 tokens per layer and head, pieces of " + std::to_string(head_bytes) +
                                  " B, non-contiguous to non-contiguous, one call"}));
    results.push_back(FigureJson({"sparse_vs_naive/" + n, "GB/s", true, sparse, "sparse_naive/" + n, sparse_naive,
                                  "batched sparse read over the per-piece loop"}));
    results.push_back(FigureJson({"scatter_vs_naive/" + n, "GB/s", true, sr, "naive_read/" + n, naive_r,
                                  "batched scatter-read over the naive per-piece loop"}));
  }
  pool->reset();
  ::unlink(path.c_str());
  nlohmann::json report;
  report["suite"] = "transfer";
  report["machine"] = std::move(machine);
  report["repetitions"] = reps;
  report["blocks_per_request"] = blocks;
  report["threads"] = xfer.options().threads;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
