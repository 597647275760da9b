// The `cxlkv` command line: one Add*Commands per group of subcommands (cmd_*.cc). Each
// subcommand stores its outcome in the shared CommandResult; main() prints a failure as one
// line and turns it into the exit code.
#ifndef CXLKV_TOOLS_CXLKV_COMMANDS_H_
#define CXLKV_TOOLS_CXLKV_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cxlkv/pool.h"
#include "cxlkv/region.h"
#include "cxlkv/status.h"
#include "rpc/tls.h"
#include "serve/long_context.h"

namespace cxlkv::cli {

struct CommandResult {
  Status status;
  int failure_exit_code = 1;  // exit code when status is not ok (get of a missing key: 2)
};

void AddRegionCommands(CLI::App& app, CommandResult& result);  // init, info
void AddBenchCommands(CLI::App& app, CommandResult& result);   // bench
void AddDemoCommands(CLI::App& app, CommandResult& result);    // demo
void AddPoolCommands(CLI::App& app, CommandResult& result);    // stat, check
void AddCacheCommands(CLI::App& app, CommandResult& result);   // put, get, evict
void AddServeCommands(CLI::App& app, CommandResult& result);   // serve, serve-worker

void AddDaemonCommands(CLI::App& app, CommandResult& result);  // ping
void AddLongContextCommands(CLI::App& app, CommandResult& result);  // longctx
void AddGenerateCommands(CLI::App& app, CommandResult& result);     // generate
void AddRacksCommands(CLI::App& app, CommandResult& result);        // racks

// --tls-cert, --tls-key and --tls-ca (or CXLKV_TLS_CERT|KEY|CA) of a command that dials a
// cxlkvd's TCP front (cmd_daemon.cc): mutual TLS, required by a front on a non-loopback address.
void AddTlsOptions(CLI::App* command, rpc::TlsOptions* tls);

// The long-context decode scenario (cmd_longctx.cc), shared by longctx and demo: runs it,
// prints its table (and progress on stderr) when `print`, returns its JSON.
Result<nlohmann::json> RunLongContextAttention(serve::LongContextOptions o, bool print);

// Joins the pool as a short-lived client (no recovery, no prefault): as `node`, or (node < 0)
// as a node id nobody uses (cmd_cache.cc).
Result<std::unique_ptr<Pool>> OpenAsNode(const std::string& paths, int node);

// "a,b,c" → {"a", "b", "c"}: a pool of several regions.
std::vector<std::string> SplitPaths(const std::string& list);

// Shared by serve and demo (cmd_serve.cc): the engine config (a JSON file, or the built-in
// default), a progress bar on stderr.
Result<nlohmann::json> LoadModelConfig(const std::string& path);
void ProgressBar(const std::string& label, size_t done, size_t total);

// Shared by info and demo.
nlohmann::json RegionInfoJson(const RegionInfo& info);
void PrintRegionInfo(const RegionInfo& info, std::FILE* out);

}  // namespace cxlkv::cli

#endif  // CXLKV_TOOLS_CXLKV_COMMANDS_H_
